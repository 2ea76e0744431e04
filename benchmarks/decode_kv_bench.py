"""Decode attention by KV-cache dtype and tile, on one CUDA GPU (Llama-3-8B heads: 32 query,
8 KV heads of 128; bf16 queries; blocks of 16 tokens in shuffled order).

    python benchmarks/decode_kv_bench.py [--out docs-fragment.md]
    python benchmarks/decode_kv_bench.py --caches bf16 --orders seq,head \
        --cases 256x384,256x512 --tiles 64,4,3 32,4,3 [--tables both] [--new-kv]

For each (batch, context), one layer's decode attention is timed inside a CUDA graph over
enough cache copies (at least 256 MB) that every call reads its keys and values from HBM,
as a decode step does layer after layer. Rows: the bf16 cache, and the fp8 cache with its
dots in float16 (KV_F16, what the Triton backend runs for a bf16 model) and in bfloat16 (the
conversion it replaced), each with the default tile (triton_backend.launch_config: keys per
iteration, warps, stages) and a few others. GB/s = the K and V bytes the step must read once / time; "vs bf16" is the
time against the bf16 cache's default tile in the same run. Each fp8 output is checked
against the bf16 cache's (max abs difference; e4m3 keeps 3 mantissa bits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from kernels_bench import BLOCK, decode_meta  # noqa: E402
from report import emit, graph_us  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128
CASES = ((256, 384), (256, 1024), (32, 2048), (1, 8192))
TILES = (None, (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2))
CACHES = ("bf16", "fp8, f16 dots", "fp8, bf16 dots")
CACHE_FLAGS = {"bf16": "bf16", "fp8f16": "fp8, f16 dots", "fp8bf16": "fp8, bf16 dots"}
MIN_BYTES = 256 << 20
DEVICE = "cuda"  # a dry run of the table code may set "cpu" (TRITON_INTERPRET=1)


def caches(backend, spec, batch: int, ctx: int, dtype: torch.dtype, copies: int, dev):
    """`copies` (K, V) pairs stored in `dtype` (fp8: quantized), the same values for every
    dtype (seeded), so the fp8 outputs can be compared with the bf16 one."""
    shape = backend.kv_cache_shape(batch * (ctx // BLOCK), spec)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for _ in range(copies):
        pair = []
        for _ in range(2):
            t = torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=gen)
            pair.append(t.to(dtype) if dtype != torch.bfloat16 else t)
        out.append(pair)
    return out


def run_case(batch: int, ctx: int, tiles=TILES, caches_run=CACHES, orders=("seq",),
             tables=("shuffled",), new_kv: bool = False) -> list[dict]:
    """new_kv: time decode_new, a decode step's path since the decode kernel rotates and
    stores its own newest keys (one row of raw q, k, v per sequence, full-width rotary,
    the newest key at each sequence's last slot), instead of decode over a full cache."""
    from dataclasses import replace

    from tpserve.kernels.base import AttentionSpec
    from tpserve.kernels.kv_quant import FP8_DTYPE
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    dev = torch.device(DEVICE)
    spec = AttentionSpec(HEADS, KV_HEADS, D, D**-0.5, block_size=BLOCK)
    fp8 = replace(spec, kv_cache_dtype="fp8")
    metas = {"shuffled": decode_meta(batch, ctx, dev)}
    seq_meta = decode_meta(batch, ctx, dev)
    nb = ctx // BLOCK
    seq_meta.block_tables.copy_(torch.arange(batch * nb, dtype=torch.int32,
                                             device=dev).view(batch, nb))
    metas["in order"] = seq_meta
    q = torch.randn(batch, HEADS, D, dtype=torch.bfloat16, device=dev)
    if new_kv:  # raw projections as views of one row per sequence, as a model hands them
        qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * D, dtype=torch.bfloat16, device=dev)
        q, k_new, v_new = (x.view(batch, -1, D) for x in
                           qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=1))
        ang = torch.rand(batch, D, device=dev) * 6.3
        rope = (ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16))
        for m in metas.values():
            m.slot_mapping = m.block_tables[:, -1].long() * BLOCK + (ctx - 1) % BLOCK
    tokens = batch * ctx
    rows, ref, base = [], None, None
    runs = [r for r in (("bf16", torch.bfloat16, spec, True),
                        ("fp8, f16 dots", FP8_DTYPE, fp8, True),
                        ("fp8, bf16 dots", FP8_DTYPE, fp8, False)) if r[0] in caches_run]
    variants = [(t, o, tb) for tb in tables for o in orders for t in tiles]
    for label, cdtype, sp, f16 in runs:
        be = TritonAttentionBackend()
        be.fp8_dots_in_f16 = f16
        kv_bytes = 2 * tokens * KV_HEADS * D * torch.tensor([], dtype=cdtype).element_size()
        copies = max(1, -(-MIN_BYTES // kv_bytes))
        kv = caches(be, sp, batch, ctx, cdtype, copies, dev)
        for tile, order, table in variants:
            be.decode_tile = tile
            be.decode_heads_first = order == "head"
            meta = metas[table]
            def call(k, v, be=be, sp=sp, meta=meta):
                if new_kv:
                    return be.decode_new(q, k_new, v_new, rope, k, v, meta, sp)
                return be.decode(q, k, v, meta, sp)

            try:
                out = call(*kv[0])

                def step(kv=kv, call=call):
                    for k, v in kv:
                        call(k, v)

                us = graph_us(step, len(kv), 20)
            except Exception as exc:  # noqa: BLE001 - a tile over the GPU's limits
                print(f"{label} {tile}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            if ref is None:
                ref = out.float()
            if base is None:
                base = us
            row = {"batch": batch, "context": ctx, "cache": label, "grid": order + "s first",
                   "tables": table,
                   "tile": "default" if tile is None else "n{} w{} s{}".format(*tile), "us": us,
                   "gbs": kv_bytes / us / 1e3, "vs": us / base,
                   "diff": (out.float() - ref).abs().max().item()}
            rows.append(row)
            print(row, flush=True)
        del kv
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    ap.add_argument("--caches", default="bf16,fp8f16,fp8bf16",
                    help="comma list of bf16, fp8f16 (fp8, float16 dots), fp8bf16")
    ap.add_argument("--orders", default="seq",
                    help="decode grid orders: seq (sequences first, the default), head")
    ap.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES),
                    help="BATCHxCONTEXT list")
    ap.add_argument("--tiles", nargs="*", default=None,
                    help="tiles as KEYS,WARPS,STAGES ('default': launch_config's)")
    ap.add_argument("--tables", choices=("shuffled", "in-order", "both"), default="shuffled",
                    help="block tables in shuffled order (the default) or in allocation order")
    ap.add_argument("--new-kv", action="store_true",
                    help="time decode_new (raw q/k/v, the kernel rotates and stores the newest "
                    "keys: what a decode step runs) instead of decode over a full cache")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_kv_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    tiles = TILES if args.tiles is None else tuple(
        None if t == "default" else tuple(int(x) for x in t.split(",")) for t in args.tiles)
    caches_run = tuple(CACHE_FLAGS[c] for c in args.caches.split(","))
    tables = {"shuffled": ("shuffled",), "in-order": ("in order",),
              "both": ("shuffled", "in order")}[args.tables]
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    rows = [r for b, c in cases for r in run_case(b, c, tiles, caches_run,
                                                  tuple(args.orders.split(",")), tables,
                                                  args.new_kv)]
    name = torch.cuda.get_device_name()
    path = "decode_new (rotary and the newest keys in the kernel)" if args.new_kv else "decode"
    lines = [f"Decode attention, one layer, by KV-cache dtype and tile ({name}, torch "
             f"{torch.__version__}, {path}); us per call in a CUDA graph, cache cold in L2:",
             "",
             "| batch | context | cache | grid | block tables | tile | us | GB/s | vs first row "
             "| max abs diff vs first row |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['cache']} | {r['grid']} | "
                     f"{r['tables']} | {r['tile']} | "
                     f"{r['us']:.1f} | {r['gbs']:.0f} | {r['vs']:.2f} | {r['diff']:.3f} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
