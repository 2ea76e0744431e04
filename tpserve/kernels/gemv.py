"""The one-row dense GEMV (triton_gemv.py) behind plain functions: y = x W^T for one
activation row, W [N, K] in nn.Linear's layout. Decode steps of one sequence use it on CUDA
and XPU, where the vendor GEMM leaves bandwidth unused on the small projections (see
triton_gemv.py); the CPU always takes F.linear.

Which path a weight shape takes is measured, not assumed: at warmup `choose` times F.linear
and a few GEMV tiles over the model's own weights of that shape, one after another in a CUDA
graph (as a decode step meets them: each read from memory, launches back to back), and keeps
the fastest, the vendor GEMM included, so a GPU or shape where the GEMV loses keeps F.linear. The layer holds the choice (`gemv_tile`) and
`linear` dispatches on it with no lookup per call. TPSERVE_GEMV=0 keeps F.linear everywhere
(A/B measurements).

Nothing here imports Triton until a GEMV is timed or launched, so `import tpserve` works
without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Sequence
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
    vendor: str = "F.linear"  # what the tiles were timed against

    def describe(self, n: int, k: int) -> str:
        if self.tile is None:
            return f"{n}x{k}: {self.vendor} ({self.vendor_us:.1f} us, no GEMV tile was faster)"
        return (f"{n}x{k}: Triton GEMV {self.tile.label()} ({self.us:.1f} us against "
                f"{self.vendor}'s {self.vendor_us:.1f} us)")


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


Timer = Callable[[Callable[[], object], int], float]  # (run, calls in run) -> us per call


def capture(run: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """`run` captured in a CUDA graph (run once before on a side stream, so that it compiles
    outside the capture), and what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = run()
    return graph, result


def _graph_us(run: Callable[[], object], calls: int, reps: int = 10) -> float:
    """Microseconds per call of `run` (which makes `calls` launches) captured in one CUDA
    graph and replayed back to back, as decode replays its step: launch gaps and PDL
    overlap count as they will when serving."""
    graph, _ = capture(run)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def _bench_us(run: Callable[[], object], calls: int) -> float:
    """Microseconds per call of `run` by Triton's benchmarker (CUDA and XPU events, L2
    flushed before each run): the timer where CUDA graphs are not available."""
    from triton.testing import do_bench

    return do_bench(run, warmup=5, rep=20, return_mode="median") * 1e3 / calls


def _default_timer(device: torch.device) -> Timer:
    return _graph_us if device.type == "cuda" else _bench_us


def choose(weights: Sequence[torch.Tensor], timer: Timer | None = None) -> GemvChoice | None:
    """The fastest one-row path for weights of one shape [N, K] (cached per device, dtype
    and shape), or None where the GEMV cannot run. Each path is timed over all of `weights`
    one after another (a model's layers of that shape: together larger than the L2 cache, so
    each is read from memory as in a decode step). Each GEMV tile is checked against
    F.linear first; a tile that fails to build or disagrees is skipped, and logged."""
    if not _usable(weights):
        return None
    n, k = weights[0].shape
    return _fastest(weights, (weights[0].device, weights[0].dtype, n, k), timer,
                    lambda x, w: F.linear(x, w), lambda x, w, t: gemv(x, w, t),
                    "F.linear", "one-row matmul")


def choose_gated(weights: Sequence[torch.Tensor], gelu_tanh: bool,
                 timer: Timer | None = None) -> GemvChoice | None:
    """As `choose`, for a gated MLP's [gate; up] weights [2N, K]: F.linear followed by the
    gated-activation kernel (two launches) against the gated GEMV (`gated`, one launch) with
    each candidate tile, each checked against the two launches first. Measured apart from
    the plain GEMV's choice: the fused launch saves the activation's launch and its
    [gate; up] row, so it can win where F.linear beats the plain GEMV of that shape."""
    from tpserve.kernels.fused_ops import gated_act_triton, use_triton

    # TPSERVE_FUSED=0 (the fused kernels off, for A/B runs) turns this fusion off too.
    if not _usable(weights) or weights[0].shape[0] % 2 or not use_triton(weights[0]):
        return None

    n, k = weights[0].shape
    return _fastest(weights, (weights[0].device, weights[0].dtype, n, k, "gated", gelu_tanh),
                    timer, lambda x, w: gated_act_triton(F.linear(x, w), gelu_tanh),
                    lambda x, w, t: gated(x, w, t, gelu_tanh), "F.linear + activation",
                    "one-row gated MLP projection")


def _usable(weights: Sequence[torch.Tensor]) -> bool:
    w0 = weights[0]
    return not (w0.dim() != 2 or unavailable(w0.device, w0.dtype)
                or any(w.stride(1) != 1 or w.shape != w0.shape for w in weights))


def _fastest(weights: Sequence[torch.Tensor], key: tuple, timer: Timer | None,
             vendor: Callable, candidate: Callable, vendor_name: str,
             what: str) -> GemvChoice | None:
    """The faster of `vendor(x, w)` and `candidate(x, w, tile)` over CANDIDATES, timed over
    all of `weights`; cached under `key`."""
    if key in _CHOSEN:
        return _CHOSEN[key]
    w0 = weights[0]
    n, k = w0.shape
    timer = timer or _default_timer(w0.device)
    x = torch.randn(1, k, dtype=w0.dtype, device=w0.device)
    calls = len(weights)
    try:
        ref = vendor(x, w0).float()
        vendor_us = timer(lambda: [vendor(x, w) for w in weights], calls)
    except (RuntimeError, torch.OutOfMemoryError) as exc:  # e.g. no memory for the timing
        log.warning("%s %dx%d stays on %s: timing it failed (%s)", what, n, k, vendor_name,
                    str(exc).splitlines()[0][:200])
        _CHOSEN[key] = None
        return None
    best: tuple[float, GemvTile | None] = (vendor_us, None)
    for tile in CANDIDATES:
        try:
            err = (candidate(x, w0, tile).float() - ref).norm() / ref.norm().clamp(min=1e-30)
            if err > 1e-2:
                raise ValueError(f"relative error {float(err):.2e} against {vendor_name}")
            us = timer(lambda t=tile: [candidate(x, w, t) for w in weights], calls)
        except Exception as exc:  # noqa: BLE001 - a tile this device cannot build or run
            log.warning("%s: GEMV tile %s skipped for %dx%d: %s", what, tile.label(), n, k, exc)
            continue
        if us < best[0]:
            best = (us, tile)
    choice = _CHOSEN[key] = GemvChoice(best[1], best[0], vendor_us, vendor_name)
    log.info("%s %s", what, choice.describe(n, k))
    return choice


def assign(modules: Iterable[torch.nn.Module]) -> dict[tuple[int, int], GemvChoice]:
    """Set `gemv_tile` on every module that holds one (the float linear layers and the LM
    head) from `choose` over all weights of its shape, and `gemv_gated_tile` on those marked
    `gemv_gated` (a gated MLP's [gate; up] projection) from `choose_gated`; returns the
    plain choice per shape."""
    groups: dict[tuple, list[torch.nn.Module]] = {}
    for m in modules:
        weight = getattr(m, "weight", None)
        if hasattr(m, "gemv_tile") and isinstance(weight, torch.Tensor):
            groups.setdefault((weight.device, weight.dtype, *weight.shape), []).append(m)
    chosen = {}
    for group in groups.values():
        # A tied LM head shares the embedding's tensor: time each tensor once.
        weights = list({id(m.weight): m.weight for m in group}.values())
        choice = choose(weights)
        for m in group:
            m.gemv_tile = choice.tile if choice else None
        if choice:
            chosen[tuple(weights[0].shape)] = choice
        # The [gate; up] projections of gated MLPs (GatedActivation.fuse_with marked them
        # with their activation) also get the fused path's own choice.
        for gelu_tanh in (False, True):
            fused = [m for m in group if getattr(m, "gemv_gated", None) is gelu_tanh]
            if fused:
                gated_choice = choose_gated(
                    list({id(m.weight): m.weight for m in fused}.values()), gelu_tanh)
                for m in fused:
                    m.gemv_gated_tile = gated_choice.tile if gated_choice else None
    return chosen


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, rounded to x's dtype: an RMSNorm whose weight is one (its
    weight folded into the next layer's, RMSNorm.fold_into). The torch reference of the
    GEMV's RMS mode."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, tile: GemvTile | None,
           rms_eps: float | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight) without bias: through the GEMV when `tile` is set (warmup chose
    it for this weight) and x holds one row, else through F.linear. rms_eps: x is normalised
    first (`rms_unit`); residual: returns residual + the product (rounded to the dtype
    first). In the GEMV both cost no launch of their own."""
    if tile is not None and x.numel() == x.shape[-1]:
        return gemv(x.reshape(1, -1), weight, tile, rms_eps, residual).view(
            *x.shape[:-1], weight.shape[0])
    y = F.linear(x if rms_eps is None else rms_unit(x, rms_eps), weight)
    return y if residual is None else y + residual


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: GemvTile = DEFAULT_TILE,
         rms_eps: float | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] times weight [N, K]^T -> [1, N] in x's dtype; rms_eps and residual as in
    `linear`."""
    from tpserve.kernels import triton_gemv

    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} is not one row matching weight "
                         f"{tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight must be contiguous along K")
    if residual is not None and residual.numel() != n:
        raise ValueError(f"gemv: residual {tuple(residual.shape)} does not match {n} outputs")
    x = x.contiguous()
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    res = out if residual is None else residual.contiguous()
    grid = (-(-n // tile.block_n),)
    triton_gemv.gemv_kernel[grid](
        x, weight, out, res, n, k, weight.stride(0), 0.0 if rms_eps is None else rms_eps,
        EVEN_N=n % tile.block_n == 0, EVEN_K=k % tile.block_k == 0, PREFETCH=tile.prefetch,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, RMS=rms_eps is not None,
        RESIDUAL=residual is not None, num_warps=tile.warps, **pdl.launch(x.device))
    return out


def gated(x: torch.Tensor, weight: torch.Tensor, tile: GemvTile,
          gelu_tanh: bool) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) for x [1, K] and weight [2N, K] = [gate; up] (a gated
    MLP's fused projection): [1, N] in x's dtype, one launch. The activation is silu, or the
    tanh GELU with `gelu_tanh`. Each program reads tile.block_n weight rows, half gate and
    half up, so a tile keeps the bytes per program it has in the plain GEMV."""
    from tpserve.kernels import triton_gemv

    n2, k = weight.shape
    if x.numel() != k or n2 % 2 or weight.stride(1) != 1:
        raise ValueError(f"gated gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "are not one row and a contiguous [gate; up] weight")
    n, block_n = n2 // 2, max(1, tile.block_n // 2)
    x = x.reshape(1, k).contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    triton_gemv.gemv_gated_kernel[(-(-n // block_n),)](
        x, weight, out, n, k, weight.stride(0), EVEN_N=n % block_n == 0,
        EVEN_K=k % tile.block_k == 0, PREFETCH=tile.prefetch, BLOCK_N=block_n,
        BLOCK_K=tile.block_k, GELU_TANH=gelu_tanh, num_warps=tile.warps,
        **pdl.launch(x.device))
    return out
