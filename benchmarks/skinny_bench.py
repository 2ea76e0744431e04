"""Decode matmuls of a few rows (2-8 sequences): cuBLAS (F.linear) against two Triton kernels
defined here, at the Llama-3-8B layer shapes (tp = 1), bf16, one CUDA GPU. A question to
answer before building one into the server: does a kernel that streams the weight once,
like the one-row GEMV, beat cuBLAS at 2-8 rows, where a step takes 4.85 ms at 8 rows
against 4.04 ms at one (docs/benchmarks.md)?

- `fma`: the one-row GEMV's design with ROWS activation rows: each program owns BLOCK_N
  output columns for all rows, keeps [ROWS, BLOCK_N, BLOCK_K] products in float32 registers
  (CUDA cores) and sums them once.
- `dot`: tensor cores, the weight tile [BLOCK_N, BLOCK_K] times x^T [BLOCK_K, 16] (rows
  padded to 16), Triton's pipelined loop (num_stages).

Each case is timed in a CUDA graph over weight copies of >= 256 MB (each call reads its
weight from HBM, as a decode step reads 32 layers in turn) and checked against F.linear.

    python benchmarks/skinny_bench.py --rows 2 4 8 --out skinny.md     # needs CUDA
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from report import emit, graph_us  # noqa: E402

SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096))
STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(x_ptr, w_ptr, out_ptr, M, N, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        x_ptrs = x_ptr + rows[:, None] * K + offs_k[None, :]
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k0).to(tl.float32)
            x = tl.load(x_ptrs + k0, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
        y = tl.sum(acc, axis=2)
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None])

    @triton.jit
    def dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        xt_ptrs = x_ptr + rows[None, :] * K + offs_k[:, None]
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = tl.load(w_ptrs + k0)
            xt = tl.load(xt_ptrs + k0, mask=(rows < M)[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
        tl.store(out_ptr + rows[None, :] * N + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[None, :])

    def fma(x, w, bn, bk, warps):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        rows = max(2, 1 << (m - 1).bit_length())
        fma_kernel[(n // bn,)](x, w, out, m, n, k, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk,
                               num_warps=warps)
        return out

    def dot(x, w, bn, bk, stages, warps):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        dot_kernel[(n // bn,)](x, w, out, m, n, k, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                               num_warps=warps)
        return out

    return fma, dot


def variants(rows: int):
    fma, dot = kernels()
    for bn, bk, warps in itertools.product((2, 4, 8), (128, 256, 512), (4, 8)):
        if rows * bn * bk <= 16384:
            yield f"fma n{bn} k{bk} w{warps}", lambda x, w, a=(bn, bk, warps): fma(x, w, *a)
    for bn, bk, stages, warps in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6),
                                                   (4,)):
        if bn * bk <= 16384:
            yield (f"dot n{bn} k{bk} s{stages} w{warps}",
                   lambda x, w, a=(bn, bk, stages, warps): dot(x, w, *a))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skinny_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    lines = [f"Machine: {torch.cuda.get_device_name(0)}; {datetime.date.today()}; torch "
             f"{torch.__version__}; bf16, weights read from HBM (CUDA graph over copies)", "",
             "| rows | shape | N x K | F.linear us (GB/s) | best Triton us (GB/s) | best | "
             "Triton / F.linear |", "| --- | --- | --- | --- | --- | --- | --- |"]
    step = {}
    for name, n, k in SHAPES:
        count = max(1, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(count)]
        gb = n * k * 2 / 1e3
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = F.linear(x, ws[0]).float()
            vendor = graph_us(lambda ws=ws, x=x: [F.linear(x, w) for w in ws], len(ws),
                              args.reps)
            best = (float("inf"), "-")
            for label, fn in variants(m):
                try:
                    err = ((fn(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"relative error {err:.2e}")
                    us = graph_us(lambda ws=ws, x=x, fn=fn: [fn(x, w) for w in ws], len(ws),
                                  args.reps)
                except Exception as exc:  # noqa: BLE001 - a variant this GPU cannot build
                    print(f"{name} rows {m} {label}: {str(exc).splitlines()[0][:120]}")
                    continue
                best = min(best, (us, label))
            s = step.setdefault(m, [0.0, 0.0])
            s[0] += vendor * STEP[name]
            s[1] += min(vendor, best[0]) * STEP[name]
            lines.append(f"| {m} | {name} | {n} x {k} | {vendor:.1f} ({gb / vendor:,.0f}) | "
                         f"{best[0]:.1f} ({gb / best[0]:,.0f}) | {best[1]} | "
                         f"{best[0] / vendor:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", "| rows | one step's matmuls, F.linear ms | the faster of the two per shape, ms |",
              "| --- | --- | --- |"]
    lines += [f"| {m} | {a / 1e3:.2f} | {b / 1e3:.2f} |" for m, (a, b) in sorted(step.items())]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
