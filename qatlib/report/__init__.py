"""The experiment report: one self-contained HTML file plus DVC metrics and plot CSVs.

``build_report(exp_dir, out_html)`` is the API (`build`); ``scripts/report.py`` the command line.
`inputs` reads the ``results/<exp>/`` layout, `metrics` computes the numbers (recovery, evaluation
rows, DVC outputs), `sections` / `blocks` / `figures` turn them into HTML.
"""

from .build import ReportError, build_report

__all__ = ["ReportError", "build_report"]
