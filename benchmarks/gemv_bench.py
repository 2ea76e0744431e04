"""One-row weight GEMVs of a decode step: cuBLAS (torch's F.linear) against the Triton GEMV
(tpserve/kernels/triton_gemv.py) over a set of tiles, at the Llama-3-8B layer shapes (tp = 1,
and tp = 2's halves), bf16, one CUDA GPU. Each case is timed in a CUDA graph over enough
weight copies (>= 256 MB) that every call reads its weight from HBM, as a decode step reads
32 layers one after another. Then what the server's warmup chooses for each shape.

    python benchmarks/gemv_bench.py --out gemv.md        # needs CUDA

Prints us and GB/s (weight bytes / time) per shape and tile, the best tile per shape, and
the sum over one step of 32 layers + LM head; appends the tables to --out. Every Triton
result is checked against F.linear (bf16, relative error < 1e-2).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from report import cuda_args, emit, graph_us  # noqa: E402

SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096),
          ("qkv tp2", 3072, 4096), ("o_proj tp2", 4096, 2048), ("gate_up tp2", 14336, 4096),
          ("down tp2", 4096, 7168), ("lm_head tp2", 64128, 4096))
STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def tiles():
    from tpserve.kernels.gemv import GemvTile

    for bn, bk, w, pf in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8),
                                           (True, False)):
        if bn * bk <= 8192:
            yield GemvTile(bn, bk, w, pf)


def copies_of(n: int, k: int, dev) -> list[torch.Tensor]:
    count = max(1, -(-256 * 2**20 // (n * k * 2)))
    return [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(count)]


def check(y: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    if err > 1e-2:
        raise AssertionError(f"relative error {err:.2e}")
    return err


def main() -> int:
    from tpserve.kernels.gemv import choose, gemv

    args = cuda_args(__doc__, "gemv_bench")
    if args is None:
        return 2
    dev = torch.device("cuda")
    best: dict[str, tuple] = {}
    rows, choices = [], []
    for name, n, k in SHAPES:
        ws = copies_of(n, k, dev)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        gb = n * k * 2 / 1e3
        cublas = graph_us(lambda ws=ws, x=x: [F.linear(x, w) for w in ws], len(ws), args.reps)
        ref = F.linear(x, ws[0])
        results = []
        for tile in tiles():
            try:
                check(gemv(x, ws[0], tile), ref)
                us = graph_us(lambda ws=ws, x=x, t=tile: [gemv(x, w, t) for w in ws], len(ws),
                              args.reps)
            except Exception as exc:  # noqa: BLE001 - a tile over the GPU's limits
                print(f"{name} {tile.label()}: {type(exc).__name__}: {str(exc)[:160]}",
                      flush=True)
                continue
            results.append((us, tile))
        results.sort(key=lambda r: r[0])
        us, tile = results[0]
        best[name] = (cublas, us, tile)
        print(f"{name} {n}x{k}: cuBLAS {cublas:.1f} us ({gb / cublas:.0f} GB/s); best "
              + ", ".join(f"{t.label()} {u:.1f}" for u, t in results[:5]), flush=True)
        rows.append(f"| {name} | {n} x {k} | {cublas:.1f} ({gb / cublas:.0f}) | {us:.1f} "
                    f"({gb / us:.0f}) | {tile.label()} | {us / cublas:.2f} | "
                    + ", ".join(f"{t.label()} {u:.1f}" for u, t in results[1:4]) + " |")
        choices.append(f"| {name} | {choose(ws).describe(n, k)} |")
        del ws
        torch.cuda.empty_cache()
    tot_c = sum(best[s][0] * c for s, c in STEP.items())
    tot_t = sum(min(best[s][0], best[s][1]) * c for s, c in STEP.items())
    name = torch.cuda.get_device_name()
    lines = [f"One-row GEMVs, bf16 ({name}, torch {torch.__version__}); us per call in a CUDA "
             "graph, weights cold in L2 (GB/s = weight bytes / time):", "",
             "| layer | N x K | cuBLAS us (GB/s) | Triton GEMV, best tile, us (GB/s) | tile | "
             "Triton / cuBLAS | next tiles (us) |",
             "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             f"One step (32 layers + LM head, tp = 1): cuBLAS {tot_c / 1e3:.3f} ms, the faster "
             f"of the two per shape {tot_t / 1e3:.3f} ms.", "",
             "What warmup would choose (kernels/gemv.py `choose`: F.linear or one of "
             "its candidate tiles, timed in a CUDA graph over the weight copies):", "",
             "| layer | choice |", "| --- | --- |", *choices]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
