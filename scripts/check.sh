#!/usr/bin/env bash
# The lint and type gate, run by scripts/test.sh before the tests:
#   ruff (rules E, F, W, I, B, UP; see pyproject.toml), ruff format, mypy strict over src
#   (tests type-checked with a relaxed override).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy src tests
