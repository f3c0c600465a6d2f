"""The experiment report: one self-contained HTML file plus DVC metrics and plot CSVs.

``build_report(exp_dir, out_html)`` is the API; ``python -m qatlib.report EXP_DIR --out report.html``
the command line.
"""

from .build import ReportError, build_report, main

__all__ = ["ReportError", "build_report", "main"]
