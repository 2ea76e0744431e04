"""Tile sweep of a Triton tiled matmul (defined here) against F.linear (cuBLAS) at the
Llama-3-8B layer shapes and decode batch sizes, bf16, one CUDA GPU: does a Triton GEMM with
free tile sizes and a K split beat the vendor GEMM at 64-256 rows, where a decode step's
GEMMs run at ~600 TFLOP/s against ~800 at prefill sizes? (Measured on an H200, 2026-12-02:
no; docs/benchmarks.md, "A Triton GEMM for decode batches, tried".)

    python3 benchmarks/gemm_sweep.py --out OUT [--rows 64 128 256] [--workers 12]

The kernel: program (t, s) computes output tile t (the M-blocks of one N-block adjacent, so
a weight tile comes from memory once and from L2 for the others) over K-split s; with
several splits each stores float32 partials and the split that arrives last for its tile
(a counter, acquire-release atomic after a barrier) sums them in split order. Tiles arrive
through per-thread loads or tensor descriptors (TMA), pipelined by Triton over STAGES
buffers.

Every tile is compiled first in parallel worker processes sharing one Triton cache, then
timed in the main process: a CUDA graph replays one call per weight copy (enough copies,
>= 256 MB together, that none comes from L2, as in a decode step), median of 5 replays. Each
tile's output is checked against F.linear first (relative error <= 1e-2) and skipped if it
disagrees or fails. Writes OUT/gemm_sweep.md (best tile per shape and rows next to F.linear,
and one decode step's GEMMs summed over 32 layers + LM head) and OUT/gemm_sweep.json (every
timing).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing as mp
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


@triton.jit
def _store_tile(out_ptr, ws_ptr, cnt_ptr, acc, rm, rn, M, N, som, tile,
                SPLIT: tl.constexpr):
    """Write the finished tile, or this split's share of it (see the module docstring)."""
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + rm[:, None] * som + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=omask)
    else:
        pid_k = tl.program_id(1)
        part = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partials are stored before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rm[:, None] * som + rn[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


@triton.jit
def _tile_ids(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    tile = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % num_m
    pid_n = tile // num_m
    blocks = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT)  # K-blocks per split
    k_lo = tl.program_id(1) * blocks * BLOCK_K
    k_hi = tl.minimum(K, k_lo + blocks * BLOCK_K)
    return tile, pid_m, pid_n, k_lo, k_hi


@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, sxm, swn, som,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """out [M, N] = x [M, K] W [N, K]^T through per-thread loads. Rows and columns past M
    and N read row 0 / column 0 again instead of a masked load (their results are never
    stored), so loads keep their full width. EVEN_K: every split's K range is whole blocks
    inside K (no K mask)."""
    tile, pid_m, pid_n, k_lo, k_hi = _tile_ids(M, K, BLOCK_M, BLOCK_K, SPLIT)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tl.where(rm < M, rm, 0)[:, None] * sxm + (k_lo + rk)[None, :]
    b_ptrs = w_ptr + tl.where(rn < N, rn, 0)[None, :] * swn + (k_lo + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k + rk)[None, :] < k_hi, other=0.0)
            b = tl.load(b_ptrs, mask=(k + rk)[:, None] < k_hi, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_tile(out_ptr, ws_ptr, cnt_ptr, acc, rm, rn, M, N, som, tile, SPLIT)


@triton.jit(do_not_specialize=["M"])
def linear_tma_kernel(x_desc, w_desc, out_ptr, ws_ptr, cnt_ptr, M, N, K, som,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT: tl.constexpr, STAGES: tl.constexpr):
    """As linear_kernel, the tiles loaded through tensor descriptors (x_desc blocks
    [BLOCK_M, BLOCK_K], w_desc blocks [BLOCK_N, BLOCK_K]; reads past the edges give
    zeros)."""
    tile, pid_m, pid_n, k_lo, k_hi = _tile_ids(M, K, BLOCK_M, BLOCK_K, SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([pid_m * BLOCK_M, k])
        b = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, b.T, acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_tile(out_ptr, ws_ptr, cnt_ptr, acc, rm, rn, M, N, som, tile, SPLIT)


@dataclass(frozen=True)
class GemmTile:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 4
    stages: int = 4
    split: int = 1  # K split: programs per output tile
    tma: bool = False  # tiles through tensor descriptors (CUDA compute capability 9.0+)

    def label(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.warps} "
                f"s{self.stages}{f' x{self.split}' if self.split > 1 else ''}"
                f"{' tma' if self.tma else ''}")

    def smem_bytes(self, elem: int = 2) -> int:
        return (self.block_m + self.block_n) * self.block_k * elem * self.stages


COUNTERS = 1 << 16  # tiles of one split launch at most (counters per device)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemm: split counters must be made before graph capture "
                               "(run the split tile once first)")
        c = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


def gemm(x: torch.Tensor, weight: torch.Tensor, tile: GemmTile) -> torch.Tensor:
    """x [M, K] times weight [N, K]^T -> [M, N] in x's dtype."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"gemm: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemm: the weight must be contiguous along K")
    x = x if x.stride(1) == 1 else x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
    if tile.split > 1:
        if tiles > COUNTERS:
            raise ValueError(f"gemm: {tiles} tiles exceed the {COUNTERS} split counters")
        ws = torch.empty(tile.split, m, n, dtype=torch.float32, device=x.device)
        cnt = _counters(x.device)
    else:
        ws = cnt = out  # unused
    grid = (tiles, tile.split)
    if tile.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k])
        wd = TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k])
        linear_tma_kernel[grid](
            xd, wd, out, ws, cnt, m, n, k, out.stride(0), BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT=tile.split, STAGES=tile.stages,
            num_warps=tile.warps)
    else:
        even = k % (tile.split * tile.block_k) == 0
        linear_kernel[grid](
            x, weight, out, ws, cnt, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            SPLIT=tile.split, STAGES=tile.stages, EVEN_K=even, num_warps=tile.warps)
    return out


SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096))
LAYERS = 32
SMEM = 220 * 1024


def tiles() -> list[GemmTile]:
    out = []
    for bm, bn, (bk, stages), tma, split in itertools.product(
            (64, 128), (64, 128, 256), ((64, 3), (64, 4), (64, 5), (128, 3)), (False, True),
            (1, 2, 4)):
        warps = 8 if bm * bn > 128 * 64 else 4
        t = GemmTile(bm, bn, bk, warps, stages, split, tma)
        if t.smem_bytes() <= SMEM:
            out.append(t)
    return out


def _compile_worker(chunk: list[GemmTile]) -> list[tuple[str, str]]:
    dev = torch.device("cuda")
    errors = []
    for t in chunk:
        for k in sorted({k for _, _, k in SHAPES}):
            try:
                x = torch.randn(128, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(256, k, device=dev, dtype=torch.bfloat16)
                gemm(x, w, t)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported per tile
                errors.append((t.label(), f"{type(exc).__name__}: {str(exc)[:300]}"))
                break
    return errors


def graph_us(fn, calls: int, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--shapes", nargs="+", default=[s for s, _, _ in SHAPES])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = tiles()
    chunks = [todo[i::args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        bad = dict(e for part in pool.map(_compile_worker, chunks) for e in part)
    print(f"{len(todo)} tiles, {len(bad)} failed to build", flush=True)
    for label, err in list(bad.items())[:8]:
        print(f"  {label}: {err}", flush=True)
    dev = torch.device("cuda")
    rows = []
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        copies = max(1, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        calls = max(copies, 8)
        ws = [weights[i % copies] for i in range(calls)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, weights[0]).float()
            vendor = graph_us(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws],
                              calls)
            rows.append({"shape": name, "n": n, "k": k, "m": m, "tile": None, "us": vendor})
            best = (vendor, "F.linear")
            for t in todo:
                if t.label() in bad:
                    continue
                try:
                    err = float((gemm(x, weights[0], t).float() - ref).norm() / ref.norm())
                    if err > 1e-2:
                        raise ValueError(f"relative error {err:.2e}")
                    us = graph_us(lambda t=t, x=x, ws=ws: [gemm(x, w, t) for w in ws], calls)
                except Exception as exc:  # noqa: BLE001 - reported per tile
                    print(f"{name} m{m} {t.label()}: {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    continue
                rows.append({"shape": name, "n": n, "k": k, "m": m, "tile": asdict(t),
                             "label": t.label(), "us": us})
                best = min(best, (us, t.label()))
            print(f"{name} m{m}: F.linear {vendor:.1f} us, best {best[1]} {best[0]:.1f} us "
                  f"({best[0] / vendor:.3f})", flush=True)
        weights = ws = None  # free before the next shape's copies
        torch.cuda.empty_cache()
    (args.out / "gemm_sweep.json").write_text(json.dumps(rows))
    lines = [f"### Triton decode matmul against F.linear ({torch.cuda.get_device_name(0)}, "
             f"torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
             f"UTC)", "",
             "| shape | N x K | rows | F.linear us (TFLOP/s) | best Triton us (TFLOP/s) | tile "
             "| Triton / F.linear | top 3 |", "| --- " * 8 + "|"]
    per_step: dict[int, list[float]] = {}
    for name, n, k in SHAPES:
        for m in args.rows:
            r = [x for x in rows if x["shape"] == name and x["m"] == m]
            if not r:
                continue
            v = next(x for x in r if x["tile"] is None)["us"]
            tr = sorted((x for x in r if x["tile"]), key=lambda x: x["us"])
            if not tr:
                continue
            b = tr[0]
            fl = 2 * m * n * k / 1e6
            top = ", ".join(f"{x['label']} {x['us']:.1f}" for x in tr[:3])
            lines.append(f"| {name} | {n} x {k} | {m} | {v:.1f} ({fl / v:.0f}) | {b['us']:.1f} "
                         f"({fl / b['us']:.0f}) | {b['label']} | {b['us'] / v:.3f} | {top} |")
            mult = 1 if name == "lm_head" else LAYERS
            s = per_step.setdefault(m, [0.0, 0.0])
            s[0] += v * mult / 1e3
            s[1] += min(v, b["us"]) * mult / 1e3
    lines += ["", "One decode step's weight GEMMs (32 layers + LM head), ms:", "",
              "| rows | F.linear | faster of the two per shape |", "| --- | --- | --- |"]
    lines += [f"| {m} | {a:.2f} | {b:.2f} |" for m, (a, b) in per_step.items()]
    text = "\n".join(lines) + "\n"
    (args.out / "gemm_sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
