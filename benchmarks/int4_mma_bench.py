"""The tensor-core int4 GEMV (tpserve/kernels/quant/triton_mma.py) against the kernels it
replaces at 1-16 rows, per Llama-3-8B layer shape, on one CUDA GPU (sm_80+):

    python3 benchmarks/int4_mma_bench.py --out OUT.md

For each layer (qkv, o_proj, gate_up, down; GPTQ int4, group 128) and M = 1, 2, 4, 8, 16: the
previous path (`TPSERVE_INT4_MMA=0`: the packed GEMV at one row, the tensor-core tiles of
2-16 rows), the new kernel with its default warps and split, other warps / splits / loads
ahead (--variants), and
bf16 F.linear of the same shape. Every variant's output is checked against the previous
path first (relative error printed). Times: quant_sweep.graph_ms, a CUDA graph cycling
through >= 256 MB of weight copies so that none is served from L2, as in a decode step; us
per call and the weight bytes read per second.

--frag: also the kernel reading the weight in fragment order (tpserve/kernels/quant/frag.py),
its output required to equal the row-major kernel's bit for bit; at one row also the one-row
GEMV reading a column-blocked weight (frag.blocked_pack), required to equal the previous
path's output.

--over-16 24 32 48 64: also rows above the kernel's 16, where the 17-64 tiles run, against
the kernel launched once per 16 rows and bf16 (us summed over the four layers).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/kernels"), str(ROOT / "benchmarks")]

from quant_sweep import COPY_BYTES, GROUP, LAYERS, graph_ms, tensors, weight_bytes  # noqa: E402
from report import emit  # noqa: E402

from tpserve.kernels.quant import triton_kernel as tk  # noqa: E402
from tpserve.kernels.quant.frag import blocked_pack, frag_pack  # noqa: E402

VARIANTS = ((0, 0, 0), (0, 0, 2), (2, 0, 1), (2, 0, 2), (8, 0, 1), (4, 1, 1), (4, 1, 2),
            (4, 4, 2), (4, 8, 2), (8, 4, 2), (16, 2, 2), (4, 8, 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--variants", action="store_true", help="also time VARIANTS")
    ap.add_argument("--frag", action="store_true", help="also the fragment-order weight")
    ap.add_argument("--over-16", type=int, nargs="*", default=[], metavar="M")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="activations (and the F.linear comparison)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("int4_mma_bench.py needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    dt = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(dev)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### int4 GEMV on the tensor cores, {args.dtype} activations, {name}, "
             f"torch {torch.__version__}, {when}",
             "", "| layer | M | previous us | mma us (default) | best mma us "
             "(warps, split, ahead) | bf16 us | previous GB/s | mma GB/s | mma / previous | max rel. err "
             "| fragment-order us | fragment-order GB/s | blocked GEMV us |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    totals: dict[int, list[float]] = {}
    for lname, k, n in LAYERS:
        copies = max(1, COPY_BYTES // weight_bytes("int4", k, n))
        sets = tensors(k, n, dev, copies)
        frags = [frag_pack(t[0]) for t in sets] if args.frag else []
        wbf = [torch.randn(n, k, device=dev, dtype=dt)
               for _ in range(max(1, COPY_BYTES // (2 * k * n)))]
        for m in args.batches:
            x = torch.randn(m, k, device=dev, dtype=dt)

            def prev(t, x=x):
                tk.INT4_MMA = False
                try:
                    return tk.quant_matmul(x, t[0], t[1], t[2], None, GROUP, False)
                finally:
                    tk.INT4_MMA = True

            def mma(t, w=0, s=0, a=0, x=x):
                return tk.int4_mma_matmul(x, t[0], t[1], t[2], GROUP, warps=w, split=s, ahead=a)

            ref = prev(sets[0]).float()
            err = 0.0
            for w, s, a in VARIANTS if args.variants else VARIANTS[:1]:
                y = mma(sets[0], w, s, a)
                assert y is not None, f"{lname}: the mma kernel refused the shape"
                err = max(err, ((y.float() - ref).abs().max() / ref.abs().max()).item())
            t_prev = graph_ms([lambda t=t: prev(t) for t in sets]) * 1e3
            t_mma = graph_ms([lambda t=t: mma(t) for t in sets]) * 1e3
            best, best_v = t_mma, "default"
            if args.variants:
                for w, s, a in VARIANTS[1:]:
                    us = graph_ms([lambda t=t, w=w, s=s, a=a: mma(t, w, s, a) for t in sets]) * 1e3
                    if us < best:
                        best, best_v = us, f"{w}, {s}, {a}"
            t_frag = float("nan")
            if args.frag:
                yf = tk.int4_mma_matmul(x, *sets[0][:3], GROUP, frag=frags[0])
                assert torch.equal(yf, mma(sets[0])), f"{lname} M={m}: fragment order differs"
                t_frag = graph_ms([lambda t=t, f=f, x=x: tk.int4_mma_matmul(x, *t[:3], GROUP, frag=f)
                                   for t, f in zip(sets, frags)]) * 1e3
                totals.setdefault(-m, [0.0])[0] += t_frag
            t_blk = float("nan")
            if args.frag and m == 1:
                tile = tk.pick_tile("int4", 1, n, k, tk._num_sms(dev))
                bws = [blocked_pack(t[0], tile.block_n) for t in sets]
                yb = tk.quant_matmul(x, *sets[0][:3], None, GROUP, False, blocked_w=bws[0])
                assert torch.equal(yb, prev(sets[0])), f"{lname}: the blocked GEMV differs"
                t_blk = graph_ms([lambda t=t, b=b, x=x: tk.quant_matmul(
                    x, *t[:3], None, GROUP, False, blocked_w=b) for t, b in zip(sets, bws)]) * 1e3
                del bws
            t_bf = graph_ms([lambda wb=wb, x=x: torch.nn.functional.linear(x, wb) for wb in wbf]) * 1e3
            gb = weight_bytes("int4", k, n) / 1e3
            tot = totals.setdefault(m, [0.0, 0.0, 0.0])
            tot[0] += t_prev
            tot[1] += t_mma
            tot[2] += t_bf
            lines.append(f"| {lname} | {m} | {t_prev:.1f} | {t_mma:.1f} | {best:.1f} ({best_v}) "
                         f"| {t_bf:.1f} | {gb / t_prev:.0f} | {gb / t_mma:.0f} "
                         f"| {t_mma / t_prev:.2f} | {err:.2e} | {t_frag:.1f} | {gb / t_frag:.0f} "
                         f"| {t_blk:.1f} |")
            print(lines[-1], flush=True)
        del sets, wbf, frags
        torch.cuda.empty_cache()
    lines += ["", "| M | four layers: previous us | mma us | bf16 us | x 32 layers: previous ms "
              "| mma ms |", "| --- | --- | --- | --- | --- | --- |"]
    for m, (p, q, b) in ((m, v) for m, v in totals.items() if m > 0):
        if -m in totals:
            b = f"{b:.1f}; fragment order {totals[-m][0]:.1f}"
        lines.append(f"| {m} | {p:.1f} | {q:.1f} | {b} | {32 * p / 1e3:.3f} "
                     f"| {32 * q / 1e3:.3f} |")
    if args.over_16:
        lines += ["", "| rows | four layers: previous us | 16 rows a launch us | bf16 us |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {m} | {a:.1f} | {b:.1f} | {c:.1f} |"
                  for m, (a, b, c) in over_16(dev, args.over_16, dt).items()]
    emit(lines, args.out)
    return 0


def over_16(dev: torch.device, rows: list[int], dt: torch.dtype) -> dict[int, list[float]]:
    """M > 16: the previous path, this kernel once per 16 rows, bf16; summed over LAYERS."""
    tot: dict[int, list[float]] = {}
    for _name, k, n in LAYERS:
        sets = tensors(k, n, dev, max(1, COPY_BYTES // weight_bytes("int4", k, n)))
        wbf = [torch.randn(n, k, device=dev, dtype=dt)
               for _ in range(max(1, COPY_BYTES // (2 * k * n)))]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)

            def prev(t, x=x):
                return tk.quant_matmul(x, t[0], t[1], t[2], None, GROUP, False)

            def chunks(t, x=x):
                return [tk.int4_mma_matmul(x[i:i + 16], t[0], t[1], t[2], GROUP)
                        for i in range(0, x.shape[0], 16)]

            s = tot.setdefault(m, [0.0, 0.0, 0.0])
            s[0] += graph_ms([lambda t=t: prev(t) for t in sets]) * 1e3
            s[1] += graph_ms([lambda t=t: chunks(t) for t in sets]) * 1e3
            s[2] += graph_ms([lambda wb=wb, x=x: torch.nn.functional.linear(x, wb)
                              for wb in wbf]) * 1e3
        del sets, wbf
        torch.cuda.empty_cache()
    return tot


if __name__ == "__main__":
    sys.exit(main())
