"""Tile sweep of the Triton int4 / fp8 weight-only matmuls at the Llama-3-8B layer shapes on
one CUDA GPU, next to bf16 torch.matmul of the same shape, to choose the tiles in
tpserve/kernels/quant/triton_tiles.py.

    python3 benchmarks/quant_sweep.py --out OUT            # sweep, choose, bench the choice
    python3 benchmarks/quant_sweep.py --out OUT --picked   # only the tiles pick_tile chooses
    python3 benchmarks/quant_sweep.py --out OUT --gemv     # int4 orders at M = 1 and 8 (below)

--gemv (a few minutes): the GPU conformance of the table's kernels in bfloat16 and float16
(small shapes, M = 1-16; weights in the order layers hold) while the variants compile, then
at M = 1 and 8 and the Llama-3-8B shapes with the LM head: int4 with the previous table's
tiles (int4-rows), int4 in the order layers hold (the table's tile and the candidates
below), fp8 and bf16; writes OUT/gemv.md, OUT/gemv.json and OUT/gemv_tiles.json (the table
with the fastest candidates for buckets 1 and 2-16).

Every variant is compiled first, in parallel worker processes sharing one Triton cache (the
conformance suite runs on the GPU meanwhile, with the fixed tile sets too), then timed in the
main process: a CUDA graph replays 32 calls that cycle through enough copies of the weights
(>= 256 MB together) that none is served from L2, as in a decode step, and the time per call
is the median of 5 replays (launch gaps inside a graph included, as served). Each variant's
output is checked against the torch reference first; a mismatch is reported and the variant
is not timed. Then, per method and batch bucket, the tile and split-K target with the least
time summed over the layers (relative to bf16) is chosen and written to OUT/quant_tiles.json
(the form of triton_tiles.TILES), and benchmarks/quant_bench.py runs with that choice.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/kernels"), str(ROOT / "benchmarks")]

from quant_conformance import tile_sets  # noqa: E402

from tpserve.kernels.quant.triton_tiles import (  # noqa: E402
    TILES,
    Tile,
    bucket,
    pick_tile,
    set_tiles,
    tiles_to_json,
    with_split,
)

LAYERS = (("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up_proj", 4096, 28672),
          ("down_proj", 14336, 4096))
LM_HEAD = ("lm_head", 4096, 128256)
SHAPES = {name: (k, n) for name, k, n in (*LAYERS, LM_HEAD)}
GROUP = 128
COPY_BYTES = 256 << 20
REPS = 32

SPLITS = (1, 2, 4, 8, 16)
# method -> bucket -> [(tile template, splits)]: templates reach every kernel option.
_GEMV_INT4 = [(bn, bk, w) for bn, bk, w in ((32, 256, 4), (32, 512, 4), (64, 256, 4),
                                            (64, 512, 4), (64, 512, 8), (16, 512, 4),
                                            (128, 256, 4), (32, 512, 2), (64, 256, 2))]
_GEMV_FP8 = [(bn, bk, 4) for bn, bk in ((8, 512), (8, 1024), (16, 512), (16, 1024),
                                        (32, 512), (32, 1024), (16, 256), (32, 256))]
TEMPLATES = {
    "int4": [
        [(Tile(0, bn, bk, w, 3, prefetch=p), SPLITS) for bn, bk, w in _GEMV_INT4
         for p in (False, True)],
        [(Tile(16, bn, bk, w, st, factor=f), (1, 2, 4, 8))
         for bn, bk, w, st in ((128, 64, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3),
                               (64, 64, 4, 4)) for f in (False, True)],
        [(Tile(bm, bn, bk, w, st, factor=f), (1, 2, 4))
         for bm, bn, bk, w, st in ((64, 128, 64, 4, 3), (64, 64, 128, 4, 3), (64, 64, 64, 4, 4),
                                   (32, 64, 128, 4, 3)) for f in (False, True)],
        [(Tile(128, 128, 64, w, st, factor=f), (1, 2, 4))
         for w, st in ((4, 4), (8, 3)) for f in (False, True)]
        + [(Tile(0, 0, 64, dense=True), (1,))],
    ],
    "fp8": [
        [(Tile(0, bn, bk, w, 3, prefetch=p), SPLITS[:4]) for bn, bk, w in _GEMV_FP8
         for p in (False, True)],
        [(Tile(16, bn, bk, 4, 3), (1, 2, 4, 8))
         for bn, bk in ((32, 256), (64, 128), (32, 512), (64, 256))],
        [(Tile(bm, bn, bk, w, st), (1, 2, 4))
         for bm, bn, bk, w, st in ((64, 128, 64, 4, 3), (64, 64, 128, 4, 3), (32, 64, 256, 4, 3),
                                   (64, 64, 64, 4, 4))],
        [(Tile(128, 128, 64, w, st), (1, 2, 4)) for w, st in ((8, 3), (4, 4))]
        + [(Tile(0, 0, 64, dense=True), (1,))],
    ],
}
BATCHES = (1, 4, 16, 64, 256, 2048)


def variants(picked: bool) -> list[tuple[str, int, str, Tile | None]]:
    """(layer, M, kind, tile); kind int4 | fp8 | bf16; tile None: what pick_tile picks."""
    out = []
    for name, k, _n in LAYERS:
        for m in BATCHES:
            out.append((name, m, "bf16", None))
            for kind in ("int4", "fp8"):
                out.append((name, m, kind, None))
                if picked:
                    continue
                for tmpl, splits in TEMPLATES[kind][bucket(m)]:
                    for sp in splits:
                        if sp == 1 or k // sp >= tmpl.block_k:
                            out.append((name, m, kind, replace(tmpl, split=sp)))
    return out


def tensors(k: int, n: int, dev: torch.device, copies: int = 1, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(copies):
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev,
                           generator=g)
        s = (torch.rand(k // GROUP, n, device=dev, generator=g) * 0.01).half()
        z = torch.randint(0, 16, (k // GROUP, n), device=dev, generator=g).half()
        w8 = (torch.randn(n, k, device=dev, generator=g) * 100).clamp(-448, 448).to(
            torch.float8_e4m3fn)
        s8 = torch.rand(n, device=dev, generator=g) * 1e-3
        sets.append((qw, s, z, w8, s8, qw.t().contiguous().t()))
    return sets


def weight_bytes(kind: str, k: int, n: int) -> int:
    if kind == "bf16":
        return 2 * k * n
    if kind == "fp8":
        return k * n + 4 * n
    return k * n // 2 + 2 * 2 * (k // GROUP) * n


def call(kind: str, x, tile, t, wb=None):
    """kind: bf16, fp8, int4 (qweight in the order layers hold it for Triton:
    TritonQuantKernel.int4_k_contiguous) or int4-rows (the checkpoint's row-major order)."""
    from tpserve.kernels.quant.triton_kernel import TritonQuantKernel, quant_matmul

    qw, s, z, w8, s8, qk = t
    if kind == "bf16":
        return torch.nn.functional.linear(x, wb)
    if kind == "fp8":
        return quant_matmul(x, w8, s8, None, None, 1, True, tile)
    k_contiguous = kind == "int4" and TritonQuantKernel.int4_k_contiguous
    return quant_matmul(x, qk if k_contiguous else qw, s, z, None, GROUP, False, tile)


def _compile_worker(chunk):
    """Run each variant once (compiling it into the shared Triton cache)."""
    dev = torch.device("cuda")
    errors, cache = [], {}
    for name, m, kind, tile in chunk:
        k, n = SHAPES[name]
        try:
            if (k, n) not in cache:
                cache.clear()
                cache[(k, n)] = tensors(k, n, dev)[0]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            call(kind, x, tile, cache[(k, n)])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported per variant
            errors.append(((name, m, kind, tile), f"{type(exc).__name__}: {str(exc)[:200]}"))
    return errors


def precompile(todo, workers: int) -> dict:
    """Variants that share a compiled kernel compile once: one per (kind, K, tile, path)."""
    seen, unique = set(), []
    for name, m, kind, tile in todo:
        if kind == "bf16":
            continue
        k = SHAPES[name][0]
        key = (kind, k, tile or ("picked", m), m == 1, name if tile and tile.dense else "")
        if key not in seen:
            seen.add(key)
            unique.append((name, m, kind, tile))
    chunks = [unique[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        errs = [e for part in pool.map(_compile_worker, chunks) for e in part]
    return dict(errs)


def graph_ms(fns) -> float:
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    del g
    return statistics.median(times)


def label(kind: str, tile: Tile | None, m: int, k: int, n: int) -> str:
    picked = tile is None and kind in ("int4", "fp8")
    t = pick_tile(kind, m, n, k, _sms()) if picked else tile
    if t is None:
        return kind
    star = "*" if picked else ""
    if t.dense:
        return f"{kind}{star} dense"
    return (f"{kind}{star} m{t.block_m} n{t.block_n} k{t.block_k} w{t.warps} s{t.stages} "
            f"x{t.split}{' pf' if t.prefetch else ''}{' fs' if t.factor else ''}")


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def time_all(todo, bad: dict, out: Path, layers=LAYERS, batches=BATCHES) -> list[dict]:
    """Batch by batch (the decode-sized ones first), every layer's variants."""
    from tpserve.kernels.quant.torch_ref import TorchQuantKernel

    dev, ref = torch.device("cuda"), TorchQuantKernel()
    rows, log = [], open(out / "quant_sweep.log", "a")
    weights = {}
    for name, k, n in layers:
        copies = {kind: max(2, min(48, math.ceil(COPY_BYTES / weight_bytes(kind, k, n))))
                  for kind in ("bf16", "int4", "fp8")}
        copies["int4-rows"] = copies["int4"]
        wbs = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(copies["bf16"])]
        weights[name] = (copies, tensors(k, n, dev, max(copies["int4"], copies["fp8"])), wbs)
    for m in batches:
        for name, k, n in layers:
            copies, sets, wbs = weights[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            refs = {"int4": ref.int4_matmul(x, *sets[0][:3], GROUP).float(),
                    "fp8": ref.fp8_matmul(x, *sets[0][3:5]).float()}
            refs["int4-rows"] = refs["int4"]
            for _, _, kind, tile in (v for v in todo if v[0] == name and v[1] == m):
                rows.append(time_one(name, k, n, m, kind, tile, x, refs, sets, wbs,
                                     copies[kind], bad))
                print(json.dumps(rows[-1]), file=log, flush=True)
        print(f"timed M={m}", flush=True)
    return rows


def time_one(name, k, n, m, kind, tile, x, refs, sets, wbs, ncopies, bad) -> dict:
    row = {"layer": name, "K": k, "N": n, "M": m, "kind": kind,
           "variant": label(kind, tile, m, k, n), "tile": asdict(tile) if tile else None}
    try:
        if (name, m, kind, tile) in bad:
            raise RuntimeError(bad[(name, m, kind, tile)])
        if kind != "bf16":
            y = call(kind, x, tile, sets[0]).float()
            err = ((y - refs[kind]).abs().max() / refs[kind].abs().max()).item()
            if not err < 2e-2:
                raise RuntimeError(f"MISMATCH relative error {err:.3g}")
        fns = [functools.partial(call, kind, x, tile, sets[i], wbs[i] if kind == "bf16" else None)
               for i in range(ncopies)]
        row["ms"] = graph_ms(fns)
        row["GB/s"] = weight_bytes(kind, k, n) / row["ms"] / 1e6
    except Exception as exc:  # noqa: BLE001 - one variant's failure is a row
        row["error"] = str(exc)[:200]
    return row


def summary(rows: list[dict], top: int) -> str:
    """Per layer and batch: bf16, the picked tile and the fastest variants of each kind."""
    lines = ["| layer | M | variant | ms | x bf16 | GB/s |", "| --- " * 6 + "|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["layer"], r["M"]), []).append(r)
    errors = [r for r in rows if "error" in r]
    for (name, m), rs in groups.items():
        bf = next((r["ms"] for r in rs if r["kind"] == "bf16" and "ms" in r), float("nan"))
        shown = []
        for kind in ("bf16", "int4", "fp8"):
            ok = sorted((r for r in rs if r["kind"] == kind and "ms" in r),
                        key=lambda r: r["ms"])
            shown += [r for r in ok if "*" in r["variant"] or kind == "bf16"] + \
                [r for r in ok[:top] if "*" not in r["variant"] and kind != "bf16"]
        for r in shown:
            lines.append(f"| {name} | {m} | {r['variant']} | {r['ms']:.4f} | "
                         f"{r['ms'] / bf:.2f} | {r['GB/s']:.0f} |")
    lines.append(f"\n{len(errors)} variant(s) failed" + "".join(
        f"\n- {r['layer']} M={r['M']} {r['variant']}: {r['error']}" for r in errors[:12]))
    return "\n".join(lines)


def choose(rows: list[dict], sms: int) -> dict[str, list[tuple[Tile, int]]]:
    """Per method and bucket, the (tile, programs per SM) whose rule-picked splits have the
    least time summed over the layers and the bucket's batches, each batch weighed by its
    bf16 total; a candidate the sweep lacks a split for is passed over."""
    timed = {(r["layer"], r["M"], r["kind"], json.dumps(r["tile"], sort_keys=True)): r["ms"]
             for r in rows if "ms" in r and r["tile"]}
    bf16: dict[int, float] = {}
    for r in rows:
        if r["kind"] == "bf16" and "ms" in r:
            bf16[r["M"]] = bf16.get(r["M"], 0.0) + r["ms"]
    table = {}
    for method in ("int4", "fp8"):
        chosen = []
        for b, templates in enumerate(TEMPLATES[method]):
            ms = [m for m in BATCHES if bucket(m) == b]
            best = (float("inf"), TILES[method][b])
            for tmpl, _ in templates:
                for per_sm in ((1,) if tmpl.dense else (1, 2, 4, 8, 16)):
                    score = 0.0
                    for name, k, n in LAYERS:
                        key = json.dumps(asdict(with_split(tmpl, per_sm, b, n, k, sms)),
                                         sort_keys=True)
                        for m in ms:
                            score += timed.get((name, m, method, key), float("inf")) / bf16[m]
                    if score < best[0]:
                        best = (score, (tmpl, per_sm))
            chosen.append(best[1])
            print(f"chose {method} bucket {b}: {best[1]} (score {best[0]:.3f})", flush=True)
        table[method] = chosen
    return table


def start_conformance(out: Path, dtypes: str, extra: tuple[str, ...] = (),
                      with_tile_sets: bool = True) -> list[subprocess.Popen]:
    """Conformance on the GPU in parallel jobs: the tile table per dtype, the fixed tile sets
    in bfloat16; extra: more arguments of quant_conformance.py (shapes, batches)."""
    script = str(ROOT / "tests/kernels/quant_conformance.py")
    jobs = [(f"table-{dt}", ["--dtypes", dt, *extra]) for dt in dtypes.split(",") if dt]
    if dtypes and with_tile_sets:
        jobs += [(f"tiles-{t}", ["--kernels", "", "--dtypes", "bfloat16", "--tile-sets", t])
                 for t in tile_sets()]
    return [subprocess.Popen(
        [sys.executable, script, "--device", "cuda", "--kernels", "triton", *extra],
        stdout=open(out / f"conformance-{name}.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}) for name, extra in jobs]


# --gemv: the previous table's int4 tiles per bucket (int4-rows), and the candidates in the
# order layers hold (row-major): GEMV tiles at M = 1 (K-blocks of 64 and 128 lie in one
# group of 128, so their scales and zero offsets load once per block), tensor-core tiles at
# M = 8 (bucket 2-16).
GEMV_BATCHES = (1, 8)
ROWS_TILES = {1: (Tile(0, 16, 512, 4, 3, prefetch=True), 2),
              8: (Tile(16, 128, 128, 4, 3, factor=True), 1)}
GEMV_CANDIDATES = {
    1: [(Tile(0, bn, bk, w, 3, prefetch=True), per_sm)
        for bn, bk, w in ((16, 512, 4), (32, 256, 4), (32, 128, 4), (64, 128, 4),
                          (128, 128, 4), (64, 64, 4), (128, 64, 4), (64, 128, 2),
                          (128, 128, 8), (256, 64, 4), (32, 128, 1), (64, 128, 1))
        for per_sm in (1, 2, 4)]
       # More programs per SM split even the widest layers (gate_up) into several waves, so
       # the last wave's tail is a smaller share of the call.
       + [(Tile(0, bn, bk, 4, 3, prefetch=True), per_sm)
          for bn, bk in ((16, 512), (16, 256), (32, 256)) for per_sm in (8, 16)]
       # Triton's shared-memory pipeline instead of register prefetch (row-major order).
       + [(Tile(0, bn, bk, 4, 3, pipeline=st), per_sm)
          for bn, bk in ((16, 512), (16, 256), (32, 256), (32, 128), (64, 128))
          for st in (3, 4) for per_sm in (4, 8, 16)],
    8: [(Tile(16, bn, bk, w, st, factor=True), per_sm)
        for bn, bk, w, st in ((128, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4),
                              (64, 256, 4, 3), (32, 512, 4, 3))
        for per_sm in (1, 2)],
}


def gemv_variants(sms: int) -> list[tuple[str, int, str, Tile | None]]:
    out = []
    for name, k, n in (*LAYERS, LM_HEAD):
        for m in GEMV_BATCHES:
            b = bucket(m)
            out += [(name, m, "bf16", None), (name, m, "fp8", None), (name, m, "int4", None),
                    (name, m, "int4-rows", with_split(*ROWS_TILES[m], b, n, k, sms))]
            cands = {with_split(t, per_sm, b, n, k, sms) for t, per_sm in GEMV_CANDIDATES[m]}
            out += [(name, m, "int4", t) for t in sorted(cands, key=str)]
    return out


def gemv_choose(rows: list[dict], sms: int) -> dict[str, list[tuple[Tile, int]]]:
    """TILES with int4's buckets 1 and 2-16 set to the candidate (tile, programs per SM)
    with the least time summed over the decoder layers (the LM head stays bf16 in the
    engine), or kept when no candidate beats the table's tile."""
    timed = {(r["layer"], r["M"], json.dumps(r["tile"], sort_keys=True)): r["ms"]
             for r in rows if "ms" in r and r["kind"] == "int4" and r["tile"]}
    table = {method: list(rules) for method, rules in TILES.items()}
    for m in GEMV_BATCHES:
        b = bucket(m)
        best = (sum(r["ms"] for r in rows if r["kind"] == "int4" and r["M"] == m
                    and not r["tile"] and "ms" in r and r["layer"] != LM_HEAD[0]),
                TILES["int4"][b])
        for tmpl, per_sm in GEMV_CANDIDATES[m]:
            score = sum(timed.get((name, m, json.dumps(asdict(with_split(
                tmpl, per_sm, b, n, k, sms)), sort_keys=True)), float("inf"))
                for name, k, n in LAYERS)
            if score < best[0]:
                best = (score, (tmpl, per_sm))
        table["int4"][b] = best[1]
        print(f"gemv: int4 bucket {b} (M = {m}): {best[1]} ({best[0] * 1e3:.1f} us over the "
              "four decoder layers)", flush=True)
    return table


def gemv_report(rows: list[dict], head: str) -> str:
    """Per layer and M: microseconds and GB/s of bf16, fp8, int4 row-major (previous tiles),
    int4 as layers hold it (table tile, fastest candidate); then sums over 32 decoder layers."""
    by = {}
    for r in rows:
        if "ms" not in r:
            continue
        key = (r["layer"], r["M"])
        kind = r["kind"] if r["kind"] != "int4" else ("int4-table" if not r["tile"] else
                                                      "int4-best")
        if kind != "int4-best" or r["ms"] < by.get(key, {}).get(kind, {"ms": 1e9})["ms"]:
            by.setdefault(key, {})[kind] = r
    kinds = ("bf16", "fp8", "int4-rows", "int4-table", "int4-best")
    lines = [head, "", "| layer | K x N | M | " + " | ".join(f"{k} us (GB/s)" for k in kinds)
             + " | best / bf16 | best int4 tile |", "| --- " * 9 + "|"]
    sums: dict[tuple[int, str], float] = {}
    for (name, m), got in by.items():
        k, n = SHAPES[name]
        cells = []
        for kind in kinds:
            r = got.get(kind)
            cells.append(f"{r['ms'] * 1e3:.1f} ({r['GB/s']:.0f})" if r else "-")
            if r and name != LM_HEAD[0]:
                sums[(m, kind)] = sums.get((m, kind), 0.0) + r["ms"] * 32
        best, bf = got.get("int4-best"), got.get("bf16")
        ratio = f"{best['ms'] / bf['ms']:.2f}" if best and bf else "-"
        lines.append(f"| {name} | {k} x {n} | {m} | " + " | ".join(cells) + f" | {ratio} | "
                     f"{best['variant'] if best else '-'} |")
    lines += ["", "Summed over the 32 decoder layers' linears (ms per step, LM head excluded):",
              "", "| M | " + " | ".join(kinds) + " | best / bf16 |", "| --- " * 7 + "|"]
    for m in GEMV_BATCHES:
        vals = [sums.get((m, kind), float("nan")) for kind in kinds]
        lines.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in vals)
                     + f" | {vals[4] / vals[0]:.2f} |")
    errors = [r for r in rows if "error" in r]
    lines.append(f"\n{len(errors)} variant(s) failed" + "".join(
        f"\n- {r['layer']} M={r['M']} {r['variant']}: {r['error']}" for r in errors[:12]))
    return "\n".join(lines) + "\n"


def run_gemv(out: Path, workers: int, dtypes: str) -> int:
    """Conformance of the table's kernels (int4 as layers hold it) in `dtypes` at small shapes,
    M = 1-16, while the variants compile; then the timings."""
    t0 = time.time()
    jobs = start_conformance(out, dtypes, ("--shapes", "256x96,200x97", "--batches",
                                           "1,2,5,16"), with_tile_sets=False)
    todo = gemv_variants(_sms())
    bad = precompile(todo, workers)
    print(f"gemv: compiled {len(todo)} variants in {time.time() - t0:.0f}s, {len(bad)} failed",
          flush=True)
    failed = 0
    for job, dt in zip(jobs, dtypes.split(","), strict=False):
        failed += job.wait() != 0
        log = out / f"conformance-table-{dt}.log"
        print(f"conformance {dt} (rc {job.returncode}):\n{log.read_text()[-1500:]}", flush=True)
    print(f"gemv: conformance done at {time.time() - t0:.0f}s", flush=True)
    rows = time_all(todo, bad, out, layers=(*LAYERS, LM_HEAD), batches=GEMV_BATCHES)
    (out / "quant_sweep.log").unlink(missing_ok=True)
    import triton
    head = (f"int4 GEMV orders ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"triton {triton.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
            f" UTC), group size {GROUP}; us per call in a CUDA graph, weights cold in L2; GB/s "
            "= weight bytes (int4: with scales and zeros) / time; int4-rows: the checkpoint's "
            "row-major order with the previous table's tile; int4-table / int4-best: "
            "the order layers hold (TritonQuantKernel.int4_k_contiguous) with the table's "
            "tile / the fastest candidate")
    text = gemv_report(rows, head)
    (out / "gemv.md").write_text(text)
    (out / "gemv.json").write_text(json.dumps(rows, indent=0))
    (out / "gemv_tiles.json").write_text(tiles_to_json(gemv_choose(rows, _sms())))
    print(text, f"gemv: done in {time.time() - t0:.0f}s", flush=True)
    return 1 if failed or any("MISMATCH" in r.get("error", "") for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--picked", action="store_true", help="time only the tiles pick_tile picks")
    ap.add_argument("--workers", type=int, default=max(1, min(10, (os.cpu_count() or 2) - 6)))
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--gemv", action="store_true",
                    help="only the int4 orders at M = 1 and 8 (see the module docstring)")
    ap.add_argument("--conformance-dtypes", default=None,
                    help="dtypes of the conformance run on the GPU ('' skips it; default "
                    "bfloat16,float16,float32, with --gemv bfloat16,float16)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.conformance_dtypes is None:
        args.conformance_dtypes = "bfloat16,float16" + ("" if args.gemv else ",float32")
    if args.gemv:
        return run_gemv(args.out, args.workers, args.conformance_dtypes)
    t0 = time.time()
    jobs = start_conformance(args.out, args.conformance_dtypes)
    todo = variants(args.picked)
    bad = precompile(todo, args.workers)
    print(f"compiled {len(todo)} variants in {time.time() - t0:.0f}s, {len(bad)} failed",
          flush=True)
    for job in jobs:  # a GPU shared with the conformance runs would disturb the timings
        job.wait()
    print(f"conformance done at {time.time() - t0:.0f}s", flush=True)
    # One file per output kind: the device tool brings back only a few files.
    logs = sorted(args.out.glob("conformance-*.log"))
    merged = "".join(f"## {log.stem}\n{log.read_text()}\n" for log in logs)
    (args.out / "quant_conformance.log").write_text(merged)
    for log in logs:
        print(log.name, log.read_text()[-900:], flush=True)
        log.unlink()
    rows = time_all(todo, bad, args.out)
    print(f"timed in {time.time() - t0:.0f}s", flush=True)
    gpu = torch.cuda.get_device_name(0)
    import triton
    head = (f"Quantized matmul sweep ({gpu}, torch {torch.__version__}, triton "
            f"{triton.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC), "
            f"group size {GROUP}; ms per call in a CUDA graph, weights cold in L2; "
            "* = the tile pick_tile chooses")
    text = head + "\n\n" + summary(rows, args.top) + "\n"
    (args.out / "quant_sweep.md").write_text(text)
    (args.out / "quant_sweep.json").write_text(json.dumps(rows, indent=0))
    print(text, flush=True)
    if args.picked:
        return 0
    table = choose(rows, _sms())
    (args.out / "quant_tiles.json").write_text(tiles_to_json(table))
    set_tiles(table)
    picked = time_all(variants(True), {}, args.out)
    text = summary(picked, 0)
    with open(args.out / "quant_sweep.md", "a") as f:
        f.write(f"\nChosen table: {tiles_to_json(table)}\n\nTimed with it:\n\n{text}\n")
    (args.out / "quant_sweep.log").unlink(missing_ok=True)  # its rows are in the JSON
    print(text, flush=True)
    import quant_bench

    return quant_bench.main(["--out", str(args.out), "--tiles",
                             str(args.out / "quant_tiles.json")])


if __name__ == "__main__":
    sys.exit(main())
