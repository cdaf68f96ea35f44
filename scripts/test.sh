#!/usr/bin/env bash
# Installs whatever is missing, then runs the whole test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh all
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q --durations=30 -n 2 --dist loadgroup --no-loadscope-reorder "$@"
