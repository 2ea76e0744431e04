"""Where the one-row int4 GEMV's time goes, on one CUDA GPU: at the Llama-3-8B layer shapes
(row-major qweight, group size 128), a kernel that only streams the packed words the way
the GEMV does (same tiles, same loads, an XOR instead of the arithmetic) next to the real
GEMV (tpserve/kernels/quant/triton_jit.py: packed bfloat16x2 arithmetic with 1 or 2 tiles
loaded ahead, float32 arithmetic, and the packed one with its loads served from the cache),
and bf16 F.linear. If streaming alone is as slow as the GEMV, bytes in flight (latency) bound it; if
it is much faster, the arithmetic does. Times are us per call in a CUDA graph cycling
through >= 256 MB of weight copies (as quant_sweep.py times them).

    python benchmarks/int4_gemv_probe.py --out probe.md     # needs CUDA and Triton
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/kernels"), str(ROOT / "benchmarks")]

from quant_sweep import COPY_BYTES, GROUP, LAYERS, graph_ms, tensors, weight_bytes  # noqa: E402
from report import emit  # noqa: E402

from tpserve.kernels.quant import triton_kernel  # noqa: E402
from tpserve.kernels.quant.triton_kernel import quant_matmul  # noqa: E402
from tpserve.kernels.quant.triton_tiles import Tile, split_for  # noqa: E402


@triton.jit
def stream_kernel(qw_ptr, out_ptr, N, sqk, K_SPAN: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, AHEAD: tl.constexpr):
    """The GEMV's loads without its arithmetic: XOR of every packed word of the span."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_K // 8)
    ptrs = qw_ptr + (tl.program_id(1) * K_SPAN // 8 + rr)[:, None] * sqk + offs_n[None, :]
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.int32)
    n1 = tl.load(ptrs)
    if AHEAD >= 2:
        n2 = tl.load(ptrs + (BLOCK_K // 8) * sqk)
    if AHEAD >= 3:
        n3 = tl.load(ptrs + (2 * BLOCK_K // 8) * sqk)
    for kk in range(0, K_SPAN, BLOCK_K):
        w = n1
        nxt = kk + AHEAD * BLOCK_K
        if AHEAD == 1:
            n1 = tl.load(ptrs + (nxt // 8) * sqk, mask=nxt < K_SPAN, other=0)
        elif AHEAD == 2:
            n1 = n2
            n2 = tl.load(ptrs + (nxt // 8) * sqk, mask=nxt < K_SPAN, other=0)
        else:
            n1 = n2
            n2 = n3
            n3 = tl.load(ptrs + (nxt // 8) * sqk, mask=nxt < K_SPAN, other=0)
        acc ^= w
    y = tl.reduce(acc, 0, _xor)
    tl.store(out_ptr + tl.program_id(1) * N + offs_n, y)


@triton.jit
def _xor(a, b):
    return a ^ b


TILES = ((16, 512, 4), (32, 256, 4), (64, 128, 4), (128, 128, 4), (32, 128, 1))


def stream(qw, out, tile, split, ahead):
    bn, bk, w = tile
    k_span = qw.shape[0] * 8 // split
    stream_kernel[(qw.shape[1] // bn, split)](qw, out, qw.shape[1], qw.stride(0), K_SPAN=k_span,
                                              BLOCK_K=bk, BLOCK_N=bn, AHEAD=ahead, num_warps=w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="activation dtype (the packed arithmetic serves bfloat16 only; "
                    "with float16 both GEMV rows run the float32 path)")
    ap.add_argument("--tiles", type=int, default=len(TILES), help="only the first N tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, k, n in LAYERS:
        copies = max(2, math.ceil(COPY_BYTES / weight_bytes("int4", k, n)))
        sets = tensors(k, n, dev, copies)
        dtype = getattr(torch, args.dtype)
        x = torch.randn(1, k, device=dev, dtype=dtype)
        wbs = [torch.randn(n, k, device=dev, dtype=dtype)
               for _ in range(max(2, math.ceil(COPY_BYTES / (2 * k * n))))]
        us = graph_ms([functools.partial(torch.nn.functional.linear, x, w) for w in wbs]) * 1e3
        rows.append((name, f"{args.dtype} F.linear", us, 2 * k * n / us / 1e3))
        ref = quant_matmul(x, *sets[0][:3], None, GROUP, False, Tile(0, 16, 512, prefetch=True))
        for bn, bk, w in TILES[:args.tiles]:
            split = split_for(n // bn, k, bk, sms, 2)
            out = torch.empty(split, n, device=dev, dtype=torch.int32)
            for ahead in (1, 2):
                fns = [functools.partial(stream, s[0], out, (bn, bk, w), split, ahead)
                       for s in sets]
                us = graph_ms(fns) * 1e3
                rows.append((name, f"stream n{bn} k{bk} w{w} x{split} ahead {ahead}", us,
                             k * n / 2 / us / 1e3))
            tile = Tile(0, bn, bk, w, prefetch=1, split=split)
            triton_kernel.PACKED_BF16 = True
            # The same GEMV with every packed row, scale and zero read from one row of memory
            # (stride 0 along K): its loads hit the cache, so this is the arithmetic alone.
            cached = [(torch.as_strided(s[0], s[0].shape, (0, 1)),
                       torch.as_strided(s[1], s[1].shape, (0, 1)),
                       torch.as_strided(s[2], s[2].shape, (0, 1))) for s in sets[:2]]
            fns = [functools.partial(quant_matmul, x, *c, None, GROUP, False, tile)
                   for c in cached]
            us = graph_ms(fns) * 1e3
            rows.append((name, f"GEMV n{bn} k{bk} w{w} x{split}, loads from cache", us,
                         weight_bytes("int4", k, n) / us / 1e3))
            for packed, ahead in ((True, 1), (True, 2), (False, 1)):
                triton_kernel.PACKED_BF16 = packed
                tile = Tile(0, bn, bk, w, prefetch=ahead, split=split)
                y = quant_matmul(x, *sets[0][:3], None, GROUP, False, tile)
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                fns = [functools.partial(quant_matmul, x, *s[:3], None, GROUP, False, tile)
                       for s in sets]
                us = graph_ms(fns) * 1e3
                kind = "bf16x2" if packed and args.dtype == "bfloat16" else "float32"
                rows.append((name, f"GEMV {kind} n{bn} k{bk} w{w} x{split} ahead {ahead}"
                             + ("" if err < 1e-2 else f" MISMATCH {err:.2g}"), us,
                             weight_bytes("int4", k, n) / us / 1e3))
            print(*rows[-7:], sep="\n", flush=True)
    head = (f"### One-row int4 GEMV: streaming against arithmetic, {args.dtype} inputs "
            f"({torch.cuda.get_device_name(0)}"
            f", torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)")
    lines = [head, "", "| layer | variant | us | GB/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c:.1f} | {d:.0f} |" for a, b, c, d in rows]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
