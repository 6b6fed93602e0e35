#!/usr/bin/env bash
# Set up (idempotent), run the lint and type gate, then the whole test suite: unit tests, real
# vLLM engines on the embedded model, real Valkey servers and JuiceFS FUSE mounts started by the
# tests, the import-layer check and the core-only install.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
