#!/usr/bin/env bash
# Installs whatever is missing, then runs the main job. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec jetflow train "$@"
