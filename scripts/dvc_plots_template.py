"""Make `dvc plots show` work offline: an HTML template with vega, vega-lite and vega-embed inlined.

DVC's default plots page loads these three libraries from a CDN, so it renders blank without a
network. This script fetches the same versions DVC uses from the npm registry (``npm pack``),
inlines their minified builds into ``.dvc/plots_template.html`` (git-ignored, ~1.5 MB) and points
DVC at it in the local config (``dvc config --local plots.html_template``). Run it once per
clone, on a machine with ``npm`` (``install.sh`` does when npm is there):

    python scripts/dvc_plots_template.py
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# The versions dvc-render's default template loads (dvc_render/vega.py).
PACKAGES = {"vega": "5.20.2", "vega-lite": "5.2.0", "vega-embed": "6.18.2"}

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- vega {vega}, vega-lite {vega_lite}, vega-embed {vega_embed}: BSD-3-Clause, (c) the Vega project (University of Washington Interactive Data Lab) -->
{scripts_inline}
    <style>
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def build(out: Path, npm: str = "npm") -> Path:
    scripts = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in PACKAGES.items():
            res = subprocess.run(
                [npm, "pack", "--silent", f"{name}@{version}"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if res.returncode != 0:
                raise SystemExit(f"error: npm pack {name}@{version} failed:\n{res.stderr.strip()}")
            tgz = Path(tmp) / res.stdout.strip().splitlines()[-1]
            with tarfile.open(tgz) as tar:
                member = tar.extractfile(f"package/build/{name}.min.js")
                if member is None:
                    raise SystemExit(f"error: {tgz.name} has no build/{name}.min.js")
                js = member.read().decode("utf-8")
            if "</script" in js:
                js = js.replace("</script", "<\\/script")
            scripts.append(f"    <script>/* {name}@{version} */\n{js}\n    </script>")
    html = PAGE.format(
        refresh_tag="{refresh_tag}",
        plot_divs="{plot_divs}",
        scripts_inline="\n".join(scripts),
        vega=PACKAGES["vega"],
        vega_lite=PACKAGES["vega-lite"],
        vega_embed=PACKAGES["vega-embed"],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="example: python scripts/dvc_plots_template.py"
    )
    ap.add_argument("--out", default=".dvc/plots_template.html", help="template to write")
    ap.add_argument(
        "--no-config", action="store_true", help="do not set plots.html_template in .dvc/config.local"
    )
    args = ap.parse_args(argv)
    npm = shutil.which("npm")
    if npm is None:
        print(
            "npm not found: `dvc plots show` keeps DVC's default page (needs a network to render)",
            file=sys.stderr,
        )
        return 1
    out = build(Path(args.out), npm)
    if not args.no_config:
        # relative paths in the DVC config are resolved against .dvc/
        rel = (
            Path(out).resolve().relative_to(Path(".dvc").resolve())
            if Path(out).resolve().is_relative_to(Path(".dvc").resolve())
            else Path(out).resolve()
        )
        subprocess.run(["dvc", "config", "--local", "plots.html_template", str(rel)], check=True)
    print(f"offline DVC plots template: {out} ({out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
