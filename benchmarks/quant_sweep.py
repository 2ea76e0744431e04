"""Tile sweep of the Triton int4 / fp8 weight-only matmuls at the Llama-3-8B layer shapes on
one CUDA GPU, next to bf16 torch.matmul of the same shape, to choose the tiles in
tpserve/kernels/quant/triton_tiles.py.

    python3 benchmarks/quant_sweep.py --out OUT            # the whole sweep
    python3 benchmarks/quant_sweep.py --out OUT --picked   # only the tiles pick_tile chooses

Every variant is compiled first, in parallel worker processes sharing one Triton cache, then
timed in the main process: a CUDA graph replays 32 calls that cycle through enough copies of
the weights (>= 256 MB together) that none is served from L2, as in a decode step, and the
time per call is the median of 5 replays (launch gaps inside a graph included, as served).
Each variant's output is checked against the torch reference first; a mismatch is reported
and the variant is not timed. The conformance suite runs on the GPU alongside the compiles.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpserve.kernels.quant.triton_tiles import Tile, pick_tile  # noqa: E402

LAYERS = (("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up_proj", 4096, 28672),
          ("down_proj", 14336, 4096))
GROUP = 128
COPY_BYTES = 256 << 20
REPS = 32

GEMV = {  # (block_k, block_n, warps, stages)
    "int4": [(128, 64, 4, 3), (128, 128, 4, 3), (256, 64, 4, 3), (256, 128, 4, 3),
             (256, 128, 8, 3), (512, 64, 4, 3), (512, 64, 8, 3), (256, 256, 8, 3),
             (256, 64, 4, 1), (256, 128, 4, 1)],
    "fp8": [(256, 16, 4, 3), (256, 32, 4, 3), (512, 16, 4, 3), (512, 32, 4, 3),
            (128, 64, 4, 3), (512, 32, 8, 3), (1024, 16, 4, 3), (256, 64, 8, 3),
            (512, 32, 4, 1)],
}
SPLITS_GEMV = (1, 2, 4, 8)
GEMM = {  # batch -> (block_m, block_n, block_k, warps, stages), splits
    16: ([(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 64, 4, 4),
          (16, 256, 64, 8, 3), (16, 32, 256, 4, 3)], (1, 2, 4)),
    64: ([(32, 128, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 128, 8, 3),
          (64, 256, 64, 8, 3), (32, 64, 256, 4, 3)], (1, 2)),
    256: ([(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
           (64, 128, 64, 4, 3), (256, 128, 64, 8, 3), (128, 64, 128, 4, 4),
           (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 4, 4)], (1,)),
}
BATCHES = {1: None, 4: 16, 16: 16, 64: 64, 256: 256, 2048: 256}  # batch -> GEMM table


def variants(picked: bool) -> list[tuple[str, int, str, Tile | None]]:
    """(layer, M, kind, tile); kind int4 | fp8 | int4-dense | bf16; tile None: pick_tile."""
    out = []
    for name, k, _n in LAYERS:
        for m, table in BATCHES.items():
            out.append((name, m, "bf16", None))
            for kind in ("int4", "fp8"):
                out.append((name, m, kind, None))
                if picked:
                    continue
                if table is None:
                    for bk, bn, w, st in GEMV[kind]:
                        for sp in SPLITS_GEMV:
                            if k // sp >= 2 * bk and sp <= max(4, k // 2048):
                                out.append((name, m, kind, Tile(0, bn, bk, w, st, sp)))
                else:
                    tiles, splits = GEMM[table]
                    for bm, bn, bk, w, st in tiles:
                        for sp in splits:
                            out.append((name, m, kind, Tile(bm, bn, bk, w, st, sp)))
            if m >= 64:
                out.append((name, m, "int4-dense", None))
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
        sets.append((qw, s, z, w8, s8))
    return sets


def weight_bytes(kind: str, k: int, n: int) -> int:
    if kind == "bf16":
        return 2 * k * n
    if kind == "fp8":
        return k * n + 4 * n
    return k * n // 2 + 2 * 2 * (k // GROUP) * n


def call(kind: str, x, tile, t, wb=None):
    from tpserve.kernels.quant.triton_kernel import int4_dequantize, quant_matmul

    qw, s, z, w8, s8 = t
    if kind == "bf16":
        return torch.nn.functional.linear(x, wb)
    if kind == "fp8":
        return quant_matmul(x, w8, s8, None, None, 1, True, tile)
    if kind == "int4-dense":
        return x @ int4_dequantize(qw, s, z, GROUP, None, x.dtype)
    return quant_matmul(x, qw, s, z, None, GROUP, False, tile)


def _compile_worker(chunk):
    """Run each variant once (compiling it into the shared Triton cache)."""
    dev = torch.device("cuda")
    errors, cache = [], {}
    for name, m, kind, tile in chunk:
        k, n = next((k, n) for lname, k, n in LAYERS if lname == name)
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
        k = next(k for lname, k, _ in LAYERS if lname == name)
        key = (kind, k, tile or ("picked", m), m == 1, name if kind == "int4-dense" else "")
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
    t = pick_tile(kind, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count) \
        if picked else tile
    if t is None:
        return kind
    return (f"{kind}{'*' if picked else ''} m{t.block_m} n{t.block_n} k{t.block_k} "
            f"w{t.warps} s{t.stages} x{t.split}")


def time_all(todo, bad: dict, out: Path) -> list[dict]:
    from tpserve.kernels.quant.torch_ref import TorchQuantKernel

    dev, ref = torch.device("cuda"), TorchQuantKernel()
    rows, log = [], open(out / "quant_sweep.log", "a")
    for name, k, n in LAYERS:
        mine = [v for v in todo if v[0] == name]
        if not mine:
            continue
        copies = {kind: max(2, min(48, math.ceil(COPY_BYTES / weight_bytes(kind, k, n))))
                  for kind in ("bf16", "int4", "fp8")}
        sets = tensors(k, n, dev, max(copies["int4"], copies["fp8"]))
        wbs = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(copies["bf16"])]
        for m in BATCHES:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            refs = {"int4": ref.int4_matmul(x, *sets[0][:3], GROUP).float(),
                    "fp8": ref.fp8_matmul(x, *sets[0][3:]).float()}
            for _, _m, kind, tile in (v for v in mine if v[1] == m):
                key = (name, m, kind, tile)
                row = {"layer": name, "K": k, "N": n, "M": m, "kind": kind,
                       "variant": label(kind, tile, m, k, n)}
                base = "int4" if kind.startswith("int4") else kind
                ncopies = copies[base]
                try:
                    if key in bad:
                        raise RuntimeError(bad[key])
                    if kind != "bf16":
                        y = call(kind, x, tile, sets[0]).float()
                        err = ((y - refs[base]).abs().max() / refs[base].abs().max()).item()
                        if not err < 2e-2:
                            raise RuntimeError(f"MISMATCH relative error {err:.3g}")
                    fns = [functools.partial(call, kind, x, tile, sets[i],
                                             wbs[i] if kind == "bf16" else None)
                           for i in range(ncopies)]
                    row["ms"] = graph_ms(fns)
                    row["GB/s"] = weight_bytes(kind if kind != "int4-dense" else "int4", k, n) \
                        / row["ms"] / 1e6
                except Exception as exc:  # noqa: BLE001 - one variant's failure is a row
                    row["error"] = str(exc)[:200]
                rows.append(row)
                print(json.dumps(row), file=log, flush=True)
        sets = wbs = None
        torch.cuda.empty_cache()
        print(f"timed {name}", flush=True)
    return rows


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
        for kind in ("bf16", "int4", "fp8", "int4-dense"):
            ok = sorted((r for r in rs if r["kind"] == kind and "ms" in r),
                        key=lambda r: r["ms"])
            shown += [r for r in ok if "*" in r["variant"]] + \
                [r for r in ok[:top] if "*" not in r["variant"]]
        for r in shown:
            lines.append(f"| {name} | {m} | {r['variant']} | {r['ms']:.4f} | "
                         f"{r['ms'] / bf:.2f} | {r['GB/s']:.0f} |")
    lines.append(f"\n{len(errors)} variant(s) failed" + "".join(
        f"\n- {r['layer']} M={r['M']} {r['variant']}: {r['error']}" for r in errors[:12]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--picked", action="store_true", help="time only the tiles pick_tile picks")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--conformance-dtypes", default="bfloat16,float16,float32",
                    help="dtypes of the conformance run on the GPU ('' skips it)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    conf = None
    if args.conformance_dtypes:
        conf = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/kernels/quant_conformance.py"), "--device", "cuda",
             "--kernels", "triton", "--dtypes", args.conformance_dtypes, "--out",
             str(args.out / "quant_conformance.md")],
            stdout=open(args.out / "quant_conformance.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    todo = variants(args.picked)
    bad = precompile(todo, args.workers)
    print(f"compiled {len(todo)} variants in {time.time() - t0:.0f}s, {len(bad)} failed",
          flush=True)
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
    print(text)
    if conf is not None:
        rc = conf.wait()
        print(f"conformance rc={rc}")
        print((args.out / "quant_conformance.log").read_text()[-2500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
