#!/usr/bin/env bash
# Installs qatlib with everything the workflow and the tests need.
# torch goes first with its exact pin: an open `torch` requirement pulls a multi-GB CUDA build on
# CPU-only machines; with 2.13.0 installed the constraint keeps every other package on it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[eval,workflow,test]"
# `dvc plots show` offline: inline vega into a local HTML template (needs npm; optional).
if command -v npm >/dev/null 2>&1; then
  $PY scripts/dvc_plots_template.py || echo "install.sh: offline DVC plots template not made (see README, DVC)" >&2
fi
