#!/usr/bin/env bash
# The KV-cache dtype on one CUDA GPU, in-process (no Ray needed), from the repository root:
#   bash benchmarks/run_gpu_kv.sh OUTDIR
# A 256 x 256/256 burst with the bf16 cache and with --kv-cache-dtype fp8, each under
# torch.profiler (kernel table: paged_decode_kernel's time per step is the number to watch),
# then the fp8 cache with wider and narrower decode tiles (TPSERVE_DECODE_BLOCK_N).
set -uo pipefail
out="${1:-gpu-kv}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; date -u; } | tee "$out/machine.txt"
burst() { python3 benchmarks/burst_profile.py --kernel triton --batch-tokens 8192 "$@" \
            --out "$out/burst.md" 2>&1 | grep -v Warning; }
burst --kv-cache-dtype auto --profile --top 8
burst --kv-cache-dtype fp8 --profile --top 8
for n in 128 32; do
  echo "TPSERVE_DECODE_BLOCK_N=$n" | tee -a "$out/burst.md"
  TPSERVE_DECODE_BLOCK_N=$n burst --kv-cache-dtype fp8
done
