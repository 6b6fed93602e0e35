#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real vLLM engines on the
# embedded model, real Redis/Valkey servers and JuiceFS FUSE mounts started by the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
