#!/usr/bin/env bash
# Set up (idempotent) and run kvtier's main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
exec .venv/bin/kvtier demo "$@"
