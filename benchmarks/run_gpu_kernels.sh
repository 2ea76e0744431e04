#!/usr/bin/env bash
# Everything docs/kernels-gpu-conformance.md and docs/benchmarks.md report, in one run on a
# CUDA machine from the repository root: bash benchmarks/run_gpu_kernels.sh OUTDIR [PART]
# PART: conformance, bench, kernels (conformance + the split-K / fused kernel tables, no
# engine) or all (default).
set -uo pipefail
out="${1:-gpu-results}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$(mktemp -d)/triton"  # start cold, like a fresh machine
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; } | tee "$out/machine.txt"
if [ "$part" != bench ]; then
# Fail fast: one small configuration compiles and matches before the long runs.
python3 tests/kernels/conformance.py --device cuda --backends triton --dtypes bfloat16 \
  --head-dims 128 --block-sizes 16 2>&1 | tee "$out/smoke.txt" || exit 1
python3 tests/kernels/conformance.py --device cuda --backends torch,triton \
  --dtypes float32,bfloat16,float16 --head-dims 64,128,256 --block-sizes 16 \
  --out "$out/gpu_conformance.md" > "$out/conformance.log" 2>&1
echo "conformance rc=$?"; tail -n 12 "$out/conformance.log"
python3 tests/kernels/fused_conformance.py --device cuda --dtypes float32,bfloat16,float16 \
  --head-dims 64,128,256 --out "$out/gpu_fused_conformance.md" > "$out/fused_conformance.log" 2>&1
echo "fused conformance rc=$?"; tail -n 16 "$out/fused_conformance.log"
python3 -m pytest -m gpu tests/kernels/test_conformance.py tests/kernels/test_fused.py \
  tests/test_sampler.py tests/test_warmup.py -q -s -p no:cacheprovider > "$out/pytest_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -n 8 "$out/pytest_gpu.txt"
fi
[ "$part" = conformance ] && exit 0
if [ "$part" = kernels ]; then
  python3 benchmarks/kernels_bench.py --part kernels --out "$out" > "$out/bench.log" 2>&1
  echo "kernel tables rc=$?"; tail -n 30 "$out/bench.log"
  exit 0
fi
python3 benchmarks/kernels_bench.py --out "$out" > "$out/bench.log" 2>&1
echo "bench rc=$?"; tail -n 45 "$out/bench.log"
