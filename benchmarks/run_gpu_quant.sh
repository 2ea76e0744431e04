#!/usr/bin/env bash
# Quantized kernels on a CUDA machine, from the repository root:
#   bash benchmarks/run_gpu_quant.sh OUTDIR [PART]
# PART kernels: conformance of torch and triton (int4 GEMV/GEMM with and without act-order,
# fp8; Triton's fixed tile sets too) in three dtypes, then int4 / fp8 / bf16 matmul timings
# at the Llama-3-8B layer shapes. PART sweep: benchmarks/quant_sweep.py (tiles timed in CUDA
# graphs, the chosen table in OUT/sweep/quant_tiles.json, quant_bench.py with it).
# PART engine: the in-process engine on that shape in bf16, GPTQ int4 and fp8 (ms/token,
# tok/s, GB per GPU). PART all (default): kernels and engine.
# PART gemv (a few minutes): CUDA conformance of the int4 kernels in bf16 and fp16
# first (small shapes, M = 1-16), then int4 with the previous tiles vs the order layers hold (table
# tile, candidates) vs fp8 vs bf16 at M = 1 and 8 in CUDA graphs, Llama-3-8B shapes and the
# LM head (OUT/gemv/gemv.md; the fastest candidates in OUT/gemv/gemv_tiles.json).
# PART int4 (under 4 min): gemv, then the engine in GPTQ int4 (with gemv's tiles) and bf16.
set -uo pipefail
out="${1:-gpu-quant-results}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; } | tee "$out/machine.txt"
if [ "$part" = gemv ] || [ "$part" = int4 ]; then
# One Triton cache for the sweep and the engine (the engine's default), so the engine reuses
# the GEMVs the sweep compiled; timeout ends each step's whole process group.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.cache/tpserve/triton}"
timeout 300 python3 benchmarks/quant_sweep.py --gemv --out "$out/gemv" > "$out/gemv.log" 2>&1
echo "gemv rc=$?"; grep -E "^conformance|^\| (triton|kernel)|FAILED|^gemv" "$out/gemv.log"
cat "$out/gemv/gemv.md" 2>/dev/null
[ "$part" = gemv ] && exit 0
tiles=()
[ -s "$out/gemv/gemv_tiles.json" ] && tiles=(--tiles "$out/gemv/gemv_tiles.json")
timeout 240 python3 benchmarks/quant_engine.py --out "$out" --formats gptq-int4 bf16 \
  ${tiles[@]+"${tiles[@]}"} > "$out/quant_engine.log" 2>&1
echo "engine rc=$?"; tail -n 12 "$out/quant_engine.log"
exit 0
fi
if [ "$part" = sweep ]; then
python3 benchmarks/quant_sweep.py --out "$out/sweep" > "$out/quant_sweep.log" 2>&1
echo "sweep rc=$?"; tail -n 60 "$out/quant_sweep.log"
exit 0
fi
if [ "$part" != engine ]; then
python3 tests/kernels/quant_conformance.py --device cuda --kernels torch,triton \
  --dtypes float32,bfloat16,float16 --tile-sets all --out "$out/quant_conformance.md" \
  > "$out/quant_conformance.log" 2>&1
echo "conformance rc=$?"; tail -n 12 "$out/quant_conformance.log"
python3 benchmarks/quant_bench.py --out "$out" > "$out/quant_bench.log" 2>&1
echo "bench rc=$?"; tail -n 40 "$out/quant_bench.log"
fi
[ "$part" = kernels ] && exit 0
python3 benchmarks/quant_engine.py --out "$out" > "$out/quant_engine.log" 2>&1
echo "engine rc=$?"; tail -n 12 "$out/quant_engine.log"
