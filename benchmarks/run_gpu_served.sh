#!/usr/bin/env bash
# The served-path numbers of docs/benchmarks.md in one run on a CUDA machine, from the
# repository root (Ray, FastAPI and uvicorn importable):
#   bash benchmarks/run_gpu_served.sh OUTDIR [OLD_TREE]
# OLD_TREE: another checkout (e.g. the previous release) launched in the same run, so the
# two trees' numbers are side by side. Then the in-process step profile and transformers.
set -uo pipefail
out="${1:-gpu-served}"
old="${2:-}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export PYTHONPATH_PREFIX="${PYTHONPATH_PREFIX:-}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, ray; print('torch', torch.__version__, 'triton', triton.__version__, 'ray', ray.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; date -u; } | tee "$out/machine.txt"
trees=(--tree "new=$PWD")
[ -n "$old" ] && trees=(--tree "old=$old" "${trees[@]}")
python3 benchmarks/serve_bench.py "${trees[@]}" --device cuda --dtype bfloat16 \
  --max-total-tokens 8192 --long --concurrency 32 256 --out "$out/served.md" --logs "$out" \
  --launch-args --kernel triton 2>&1 | grep -v Warning | tee "$out/served.log"
echo "served rc=${PIPESTATUS[0]}"
