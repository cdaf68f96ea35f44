#!/usr/bin/env bash
# Installs whatever is missing, lints and type-checks jetflow/ (ruff, mypy), builds the docs site strictly
# (mkdocs: a broken link or anchor, or a generated reference that fails, stops it; not --quiet, which would
# hide them), then runs the default test suite (GPU tests skip without CUDA; `bash scripts/test.sh -m long`
# runs the long ones instead).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh all
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check --quiet jetflow  # the linter (pyproject's [tool.ruff]); a finding fails the run before the tests
mypy  # the type checker over jetflow/ (pyproject's [tool.mypy], its list of modules not yet checked)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict  # docs/ -> site/ (mkdocs.yml; scripts/gen_docs.py, a few seconds)
exec python -m pytest -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder "$@"
