"""The README's picture of the report: ``results/<exp>/report.html`` rendered by headless Chromium.

    python -m qatlib.site screenshot [--report results/smollm2-135m/report.html] [--out docs/img/report.png]

Chromium runs with a throw-away profile and nothing that reaches the network (no sync, no
component updates, no background requests): the report is self-contained (figures inlined), so
what it draws is the file alone. Debian: ``apt-get install chromium``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def screenshot(
    report: str | os.PathLike, out: str | os.PathLike, *, width: int = 1280, height: int = 1050
) -> Path:
    """Render ``report`` at ``width`` x ``height`` CSS pixels into the PNG ``out`` (the top of the page:
    the headline table a reader sees first). Raises FileNotFoundError without the report or a
    browser, RuntimeError when the browser writes no picture."""
    report, out = Path(report).resolve(), Path(out)
    if not report.is_file():
        raise FileNotFoundError(f"{report}: no report (run `snakemake` first)")
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError(
            f"no headless browser found ({', '.join(BROWSERS)}); Debian: apt-get install chromium"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qatlib-shot-") as tmp:
        png = Path(tmp) / "shot.png"
        cmd = [
            browser,
            *FLAGS,
            f"--user-data-dir={Path(tmp) / 'profile'}",
            f"--window-size={width},{height}",
            f"--screenshot={png}",
            report.as_uri(),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if not png.is_file():
            raise RuntimeError(f"{browser} wrote no screenshot (exit {res.returncode}): {res.stderr[-2000:]}")
        shutil.move(png, out)
    return out
