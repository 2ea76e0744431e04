"""Launch settings of the fused per-layer kernels (add + RMSNorm, gated activation) at the
row counts a decode step and a prefill chunk give them: us per launch in a CUDA graph, for
each num_warps (and block, for the activation). Llama-3-8B widths, bf16. Appends the table to
--out; fused_ops.py's launch rules come from it.

    python benchmarks/fused_sweep.py --out fused.md       # needs CUDA and Triton
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from report import emit, graph_us

from tpserve.kernels.fused_ops import _kernels


def timed(fn, reps: int = 50) -> float:
    """us per launch of fn, ten to a graph."""
    return graph_us(lambda: [fn() for _ in range(10)], 10, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 4096])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    k, dev, dt = _kernels(), torch.device("cuda"), torch.bfloat16
    lines = [f"### Fused kernel launch settings ({torch.cuda.get_device_name(0)}, "
             f"{datetime.date.today().isoformat()})", "",
             "| kernel | rows | setting | us | GB/s |", "| --- | --- | --- | --- | --- |"]
    for m in args.rows:
        h = args.hidden
        x = torch.randn(m, h, device=dev, dtype=dt)
        r = torch.randn(m, h, device=dev, dtype=dt)
        w = torch.ones(h, device=dev, dtype=dt)
        out, rout = torch.empty_like(x), torch.empty_like(x)
        for warps in (4, 8, 16, 32):
            us = timed(lambda warps=warps, m=m, x=x, r=r, w=w, out=out, rout=rout, h=h:
                       k.add_rms_norm_kernel[(m,)](
                           x, r, w, out, rout, h, 1e-6, 0.0, x.stride(0), r.stride(0),
                           out.stride(0), rout.stride(0), HAS_RES=True, CAST_FIRST=True,
                           BLOCK=4096, num_warps=warps))
            lines.append(f"| add_rms_norm | {m} | warps {warps} | {us:.2f} | "
                         f"{4 * m * h * 2 / us / 1e3:.0f} |")
        n = args.inter
        xa = torch.randn(m, 2 * n, device=dev, dtype=dt)
        oa = torch.empty(m, n, device=dev, dtype=dt)
        for block in (512, 1024, 2048, 4096):
            for warps in (2, 4, 8):
                us = timed(lambda block=block, warps=warps, m=m, n=n, xa=xa, oa=oa:
                           k.gated_act_kernel[(m, -(-n // block))](
                               xa, oa, n, xa.stride(0), oa.stride(0), GELU_TANH=False,
                               BLOCK=block, num_warps=warps))
                lines.append(f"| gated_act | {m} | block {block} warps {warps} | {us:.2f} | "
                             f"{3 * m * n * 2 / us / 1e3:.0f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
