#!/usr/bin/env bash
# Installs whatever is missing, lints jetflow/ (ruff), then runs the default test suite (GPU tests skip
# without CUDA; `bash scripts/test.sh -m long` runs the long ones instead).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh all
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check --quiet jetflow  # the linter (pyproject's [tool.ruff]); a finding fails the run before the tests
exec python -m pytest -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder "$@"
