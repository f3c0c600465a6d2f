#!/usr/bin/env bash
# Runs once inside the fresh conda env, from Snakemake's working directory (the repository root).
set -euo pipefail
python -m pip install -c requirements/constraints.txt -e ".[eval,workflow]"
