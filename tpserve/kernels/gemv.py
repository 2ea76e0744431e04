"""The one-row dense GEMV (triton_gemv.py) behind plain functions: y = x W^T for one
activation row, W [N, K] in nn.Linear's layout. Decode steps of one sequence use it on CUDA
and XPU, where the vendor GEMM leaves bandwidth unused on the small projections (see
triton_gemv.py); the CPU always takes F.linear.

Which path a weight shape takes is measured, not assumed: at warmup `choose` times F.linear
and a few GEMV tiles on the layer's own weight with the L2 cache flushed between calls (as a
decode step meets its weights) and keeps the fastest, the vendor GEMM included, so a GPU or
shape where the GEMV loses keeps F.linear. The layer holds the choice (`gemv_tile`) and
`linear` dispatches on it with no lookup per call. TPSERVE_GEMV=0 keeps F.linear everywhere
(A/B measurements).

Nothing here imports Triton until a GEMV is timed or launched, so `import tpserve` works
without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.kernels import pdl

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)
TARGETS = ("cuda", "xpu")


@dataclass(frozen=True)
class GemvTile:
    block_n: int = 4  # output rows per program
    block_k: int = 512  # inputs per iteration
    warps: int = 4
    prefetch: bool = True

    def label(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.warps}{' pf' if self.prefetch else ''}"


DEFAULT_TILE = GemvTile()
# The tiles warmup times against F.linear: between them the best of 44 tiles, or within 0.5%
# of it, on each Llama-3-8B shape at tp 1 and 2 on an H200 (benchmarks/gemv_bench.py,
# docs/benchmarks.md "One-row GEMV").
CANDIDATES = (GemvTile(4, 1024, 4, False), GemvTile(4, 512, 4, True),
              GemvTile(8, 512, 4, False), GemvTile(16, 256, 4, False))
_DISABLED = os.environ.get("TPSERVE_GEMV") == "0"  # read once, like TPSERVE_FUSED


@dataclass(frozen=True)
class GemvChoice:
    tile: GemvTile | None  # None: F.linear (the vendor GEMM) was the fastest
    us: float  # the chosen path's time per call
    vendor_us: float  # F.linear's

    def describe(self, n: int, k: int) -> str:
        if self.tile is None:
            return f"{n}x{k}: F.linear ({self.vendor_us:.1f} us, no GEMV tile was faster)"
        return (f"{n}x{k}: Triton GEMV {self.tile.label()} ({self.us:.1f} us against "
                f"F.linear's {self.vendor_us:.1f} us)")


_CHOSEN: dict[tuple, GemvChoice | None] = {}


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton GEMV can run on device for dtype, else why not."""
    if _DISABLED:
        return "TPSERVE_GEMV=0"
    if device.type not in TARGETS:
        return f"no Triton GEMV on {device.type}"
    if dtype not in DTYPES:
        return f"no Triton GEMV for {dtype} (float16, bfloat16)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _bench_us(fn: Callable[[], object]) -> float:
    """Median microseconds of fn() with the L2 cache flushed before each call (Triton's
    benchmarker: CUDA and XPU events)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def choose(weight: torch.Tensor, timer: Callable[[Callable[[], object]], float] | None = None
           ) -> GemvChoice | None:
    """The fastest one-row path for `weight` [N, K] (cached per device, dtype and shape), or
    None where the GEMV cannot run. Each GEMV tile is checked against F.linear before it is
    timed; a tile that fails to build or disagrees is skipped, and logged."""
    if weight.dim() != 2 or unavailable(weight.device, weight.dtype) or weight.stride(1) != 1:
        return None
    n, k = weight.shape
    key = (weight.device, weight.dtype, n, k)
    if key in _CHOSEN:
        return _CHOSEN[key]
    timer = timer or _bench_us
    x = torch.randn(1, k, dtype=weight.dtype, device=weight.device)
    ref = F.linear(x, weight).float()
    try:  # the benchmarker flushes L2 through a 256 MB buffer: the KV cache may leave less
        vendor = timer(lambda: F.linear(x, weight))
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        log.warning("one-row matmul %dx%d stays on F.linear: timing it failed (%s)", n, k,
                    str(exc).splitlines()[0][:200])
        _CHOSEN[key] = None
        return None
    best: tuple[float, GemvTile | None] = (vendor, None)
    for tile in CANDIDATES:
        try:
            err = (gemv(x, weight, tile).float() - ref).norm() / ref.norm().clamp(min=1e-30)
            if err > 1e-2:
                raise ValueError(f"relative error {float(err):.2e} against F.linear")
            us = timer(lambda t=tile: gemv(x, weight, t))
        except Exception as exc:  # noqa: BLE001 - a tile this device cannot build or run
            log.warning("one-row GEMV tile %s skipped for %dx%d: %s", tile.label(), n, k, exc)
            continue
        if us < best[0]:
            best = (us, tile)
    choice = _CHOSEN[key] = GemvChoice(best[1], best[0], vendor)
    log.info("one-row matmul %s", choice.describe(n, k))
    return choice


def assign(modules: Iterable[torch.nn.Module]) -> dict[tuple[int, int], GemvChoice]:
    """Set `gemv_tile` on every module that holds one (the float linear layers and the LM
    head) from `choose` on its weight; returns the choice per weight shape."""
    chosen = {}
    for m in modules:
        weight = getattr(m, "weight", None)
        if not hasattr(m, "gemv_tile") or not isinstance(weight, torch.Tensor):
            continue
        choice = choose(weight)
        m.gemv_tile = choice.tile if choice else None
        if choice:
            chosen[tuple(weight.shape)] = choice
    return chosen


def linear(x: torch.Tensor, weight: torch.Tensor, tile: GemvTile | None) -> torch.Tensor:
    """F.linear(x, weight) without bias: through the GEMV when `tile` is set (warmup chose
    it for this weight) and x holds one row, else through F.linear."""
    if tile is not None and x.numel() == x.shape[-1]:
        return gemv(x.reshape(1, -1), weight, tile).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: GemvTile = DEFAULT_TILE) -> torch.Tensor:
    """x [1, K] times weight [N, K]^T -> [1, N] in x's dtype."""
    from tpserve.kernels import triton_gemv

    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} is not one row matching weight "
                         f"{tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight must be contiguous along K")
    x = x.contiguous()
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    grid = (-(-n // tile.block_n),)
    triton_gemv.gemv_kernel[grid](
        x, weight, out, n, k, weight.stride(0), EVEN_N=n % tile.block_n == 0,
        EVEN_K=k % tile.block_k == 0, PREFETCH=tile.prefetch, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=tile.warps, **pdl.launch(x.device))
    return out
