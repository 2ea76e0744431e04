"""W8A8 conformance (kernels/quant/w8a8.py): the per-row e4m3 rounding of activations, and
on a GPU that has it the fp8 tensor-core matmul, against float64 oracles.

- quantize: every element of q * s within e4m3's rounding of x (half a unit in the last of
  3 mantissa bits, relative; the subnormal step near zero), each row's largest magnitude
  mapped to exactly 448, and (with `other`) the same bytes as another implementation, up to
  one e4m3 step where a float32 division rounds differently.
- matmul: w8a8_matmul against w8a8.reference (the rounded rows times the dequantized
  weight in float64), and how far both are from the weight-only product (x unrounded).

Run on a GPU:

    python3 tests/kernels/w8a8_conformance.py --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

# (M, K, N): rows above the W8A8 threshold, the Llama-3-8B layer shapes, a small odd one.
SHAPES = ((65, 4096, 6144), (256, 4096, 28672), (300, 14336, 4096), (128, 512, 208))
TOL = 1e-2  # relative Frobenius error: bfloat16 output and the tensor cores' accumulation


def quantize_errors(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> list[str]:
    """What is wrong with (q, s) as e4m3 rows of x (empty: nothing)."""
    bad = []
    xf, deq = x.double().cpu(), (q.double() * s.double()).cpu()
    sd = s.double().cpu()
    limit = torch.maximum(xf.abs() * 2.0 ** -4, sd * 2.0 ** -10)  # normal and subnormal steps
    if ((deq - xf).abs() > limit * 1.0001).any():
        worst = ((deq - xf).abs() / limit).max().item()
        bad.append(f"rounding off by {worst:.3f} of e4m3's step")
    top = q.float().abs().amax(dim=1).cpu()
    if not torch.equal(top[xf.abs().amax(dim=1) > 0], torch.full_like(top, 448.0)[
            xf.abs().amax(dim=1) > 0]):
        bad.append("a row's largest magnitude is not mapped to 448")
    return bad


def run_quantize(device: str, impl, rows: int = 37, cols: int = 3000,
                 dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """impl(x) -> (q, s) on random rows of very different magnitudes (and a zero row)."""
    from tpserve.kernels.quant.w8a8 import quantize_rows_torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, rows)[:, None]
    x[3] = 0.0
    x = x.to(dtype).to(device)
    q, s = impl(x)
    bad = quantize_errors(x, q, s)
    q_ref, s_ref = quantize_rows_torch(x)
    if not torch.allclose(s.float(), s_ref.float(), rtol=1e-6, atol=0):
        bad.append("scales differ from the torch reference")
    # Bytes equal, or one e4m3 step apart where the float32 division rounded differently.
    step = (q.float() - q_ref.float()).abs() / q_ref.float().abs().clamp(min=2.0 ** -9)
    if (step > 2.0 ** -3 + 1e-6).any():
        bad.append("bytes differ from the torch reference by more than one e4m3 step")
    return bad


def run_matmul(device: str) -> list[dict]:
    from tpserve.kernels.quant import w8a8

    rows = []
    g = torch.Generator().manual_seed(1)
    for m, k, n in SHAPES:
        x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16).to(device)
        wf = torch.randn(n, k, generator=g) * 0.02
        scale = (wf.abs().amax(dim=1) / w8a8.FP8_MAX).float()
        w = (wf / scale[:, None]).to(torch.float8_e4m3fn)
        w, scale = w.to(device), scale.to(device)
        ref = w8a8.reference(x, w, scale)
        weight_only = x.double() @ (w.double() * scale.double()[:, None]).t()
        row = {"shape": f"{m}x{k}x{n}", "reason": w8a8.why_not(x, w)}
        if row["reason"] is None:
            y = w8a8.w8a8_matmul(x, w, scale).double()
            row["error"] = ((y - ref).norm() / ref.norm()).item()
        row["activation_rounding"] = ((ref - weight_only).norm() / weight_only.norm()).item()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from tpserve.kernels.quant import w8a8

    bad = run_quantize(args.device, w8a8.quantize_rows)
    print(f"quantize rows on {args.device}: " + ("; ".join(bad) if bad else "ok"))
    failed = bool(bad)
    print("| M x K x N | W8A8 vs its float64 oracle | rounded rows vs weight-only | note |")
    print("| --- | --- | --- | --- |")
    for r in run_matmul(args.device):
        err = r.get("error")
        failed |= err is not None and err > TOL
        ran = f"{err:.2e}" if err is not None else "-"
        print(f"| {r['shape']} | {ran} | {r['activation_rounding']:.2e} | "
              f"{r['reason'] or ('FAILED' if err > TOL else 'ok')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ".")
    sys.exit(main())
