#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none): the GPU tests (`tests/gpu`: the
# connector's CUDA copies and its worker side on CUDA tensors, through real stores) and
# `kvtier bench transfer` for three cache shapes. Writes the logs and JSON rows to OUT_DIR.
#
#   bash scripts/gpu-check.sh [OUT_DIR]          (default out/gpu-check)
#
# Needs torch with CUDA and kvtier importable: an installed kvtier (`pip install -e .`), or
# PYTHONPATH=src with kvtier's core dependencies (xxhash, numpy, pydantic, pyzmq). vLLM's CUDA
# build is not needed (tests/gpu/conftest.py). On a machine that cannot reach PyPI, carry
# wheels of pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions and
# pyzmq for its Python and install them with `pip install --no-index --target DIR`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu-check}
python=${PYTHON:-python3}
mkdir -p "$out"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
"$python" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"

status=0
"$python" -m pytest -q -p no:cacheprovider -rA tests/gpu 2>&1 | tee "$out/pytest.log" || status=1

bench() {  # NAME FLAGS...: one row of `kvtier bench transfer`
    local name=$1
    shift
    "$python" -m kvtier.tools.bench.transfer "$@" --json "$out/transfer_$name.json" \
        >"$out/transfer_$name.log" 2>&1 || { status=1; tail -5 "$out/transfer_$name.log"; }
}
bench llama8b                                        # 32 layers x 8 KV heads x 128 (default)
bench qwen7b --layers 28 --kv-heads 4
bench smollm --layers 30 --kv-heads 3 --head-size 64  # the embedded model
"$python" - "$out" <<'PY'
import json, pathlib, sys
from kvtier.tools.bench.transfer import FIGURES
for path in sorted(pathlib.Path(sys.argv[1]).glob("transfer_*.json")):
    row = json.loads(path.read_text())[0]
    print(path.stem, " ".join(f"{k}={row[k + '_gbps']}" for k in FIGURES))
PY
exit $status
