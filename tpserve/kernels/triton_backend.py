"""Paged attention in Triton for CUDA and XPU (Intel's Triton backend).

Triton itself is imported only when a kernel is needed, after its on-disk cache has been
pointed at ~/.cache/tpserve/triton, so a CPU-only install lists this backend as unavailable
with a reason instead of failing to import, and a second start loads kernels from disk.

Warmup launches every kernel variant the server can use (decode for every batch-size
bucket, a mixed prefill + decode step), so no request ever waits for a compile. The compile
key of a launch holds only per-model values (see triton_kernels.py); launches are recorded
and one with a key warmup did not see is counted and logged.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from tpserve.kernels import fused_ops, kv_quant, pdl
from tpserve.kernels.base import AttentionBackend, AttentionMetadata, AttentionSpec
from tpserve.kernels.capabilities import CORE_FEATURES, CORE_FIELDS, unknown_feature_reason
from tpserve.kernels.compile_cache import (
    TRITON_TARGETS,
    cached_kernel_count,
    configure_triton_cache,
    triton_missing,
)
from tpserve.kernels.fused_ops import head_pad, rotary_write_kv_triton

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head dims the tiles take: any in this range, padded to a power of two inside the kernels
# (masked), so Phi's 80, 96 and DeepSeek's 192 (128 + 64 rope dims) run unpadded in the cache.
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# Query heads per KV head are the rows of one decode tile (padded to a power of two) and
# the head dims its width: up to 64 heads of any width to 256, and past 64 heads (Falcon
# 7B: 71 on one KV head) a 128-row tile of heads up to 64 wide, the largest run on a GPU
# (tests/test_gpu_head_geometry.py); wider or taller tiles go to the torch backend.
MAX_GROUP = 64
MAX_WIDE_GROUP_TILE = (128, 64)
MAX_SPLITS = 64  # most context splits of one decode step (flash-decoding)
# TPSERVE_DECODE_BLOCK_N=N fixes the decode tile's keys per iteration (measurements).
FORCED_DECODE_BLOCK_N = int(os.environ.get("TPSERVE_DECODE_BLOCK_N") or 0)
# An fp8 cache (kv_quant.py), attention sinks (gpt-oss) and chunked attention (Llama 4) are
# more things these kernels know.
KNOWN_FIELDS = CORE_FIELDS | {"kv_cache_dtype", "k_scale", "v_scale", "sinks", "attention_chunk"}
KNOWN_FEATURES = CORE_FEATURES | {kv_quant.FP8_FEATURE, "sinks", "chunked"}


def reduce_pad(splits: int) -> int:
    """The split reduction loads every split at once, padded to this power of two (one
    compiled variant per power; warmup builds them all, whatever the batch buckets)."""
    return max(2, 1 << (splits - 1).bit_length())


def leading_decode_rows(query_lens: tuple[int, ...]) -> int:
    """How many sequences at the head of a step have one new token each (its decode rows),
    from the host's copy of the query lengths (0 when there is none)."""
    n = 0
    for q_len in query_lens:
        if q_len != 1:
            break
        n += 1
    return n


def interpreting() -> bool:
    """TRITON_INTERPRET=1 runs the kernels in numpy on the CPU: slow, for debugging only."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or Xe cores (XPU) of `device`; under the CPU
    interpreter a small stand-in, so tests still cut contexts into several splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units",
                                                                       64))
    return 8


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one spec on one dtype: part of the compile key, fixed per model."""

    block_m: int
    block_n: int
    decode_block_n: int
    group_pad: int
    prefill_tokens: int  # new tokens per prefill tile (block_m rows = tokens x group)
    num_warps: int = 4
    num_stages: int = 2
    decode_stages: int = 2


def launch_config(dtype: torch.dtype, spec: AttentionSpec) -> LaunchConfig:
    group = spec.num_heads // spec.num_kv_heads
    # tl.dot needs every dimension >= 16: a decode tile pads its group of heads to 16 rows.
    group_pad = max(16, 1 << (group - 1).bit_length())
    dims = head_pad(spec.head_dim)  # the tile's width: registers follow it, not head_dim
    wide = dims * (4 if dtype == torch.float32 else 2)  # bytes per key row
    block_n = 64 if wide <= 256 else 32
    # Prefill rows are tokens x the query heads of one KV head: at least one whole group.
    block_m = max(64 if dims <= 128 else 32, 1 << (group - 1).bit_length())
    # Decode (benchmarks/decode_kv_bench.py on an H200; docs/benchmarks.md, "a one-row GEMV,
    # decode tiles by cache dtype"): an fp8 cache takes twice the keys per iteration, so an iteration
    # moves as many bytes as a bfloat16 one (6-31% faster than 64 keys); a float cache gains
    # 1-8% from a third pipeline stage.
    fp8 = spec.kv_cache_dtype == "fp8"
    decode_block_n = FORCED_DECODE_BLOCK_N or (2 * block_n if fp8 else block_n)
    return LaunchConfig(block_m=block_m, block_n=block_n, decode_block_n=decode_block_n,
                        group_pad=group_pad, prefill_tokens=block_m // group,
                        decode_stages=2 if fp8 else 3)


def compile_key(kind: str, dtype: torch.dtype, spec: AttentionSpec) -> tuple:
    """What Triton specialises a launch of `kind` on, given the launcher's guarantees
    (contiguous 16-byte-aligned tensors, runtime ints not specialised)."""
    cfg = launch_config(dtype, spec)
    flags = (bool(spec.sliding_window), spec.alibi, bool(spec.softcap),
             spec.kv_cache_dtype == "fp8", bool(spec.sinks), bool(spec.attention_chunk))
    tiles = (cfg.group_pad, cfg.decode_block_n) if kind == "decode" else (cfg.block_m,
                                                                           cfg.block_n)
    return (kind, str(dtype), spec.num_heads // spec.num_kv_heads, spec.head_dim,
            spec.block_size, tiles, flags)


@dataclass(frozen=True)
class WarmupCase:
    kind: str  # "decode" or "prefill"
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    key: tuple


def warmup_plan(dtype: torch.dtype, spec: AttentionSpec,
                batch_sizes: tuple[int, ...]) -> list[WarmupCase]:
    """The steps warmup runs: a decode batch of every bucket, and a mixed step whose prefill
    spans several query tiles and KV blocks next to a decode row."""
    cfg = launch_config(dtype, spec)
    ctx = 2 * spec.block_size + 3  # crosses block boundaries
    cases = [WarmupCase("decode", (1,) * b, (ctx,) * b, compile_key("decode", dtype, spec))
             for b in sorted(set(batch_sizes))]
    n = 2 * cfg.block_m + 3  # at least two query tiles, whatever the group
    cases.append(WarmupCase("prefill", (n, 1), (n + spec.block_size, ctx),
                            compile_key("prefill", dtype, spec)))
    # Decode rows ahead of a prompt, as the scheduler orders a mixed step: the decode
    # launch over the leading rows, then the prefill launch over a query_start slice.
    cases.append(WarmupCase("prefill", (1, n), (ctx, n + spec.block_size),
                            compile_key("prefill", dtype, spec)))
    return cases


@dataclass
class WarmupReport:
    seconds: float = 0.0
    variants: int = 0  # kernel variants built in this process (compiled or loaded from disk)
    compiled_from_source: int = 0  # new entries in the on-disk cache
    cases: int = 0
    keys: list[tuple] = field(default_factory=list)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    fp8_kv_cache = True
    # Decode reads sequence lengths and block tables from device memory and its grid
    # depends only on the batch size, so a captured launch replays correctly.
    cuda_graph_safe = True

    def __init__(self) -> None:
        self.launched: set[tuple] = set()
        self.warmed = False  # set after the first warmup; later specs warm up too
        self._warming = False
        self.unplanned_launches = 0
        self.reports: list[WarmupReport] = []
        self._dummy: dict[torch.device, torch.Tensor] = {}
        self._cores: dict[torch.device, int] = {}
        # TPSERVE_DECODE_SPLITS=N fixes the split count (1: no split-K), for measurements.
        self.forced_splits = int(os.environ.get("TPSERVE_DECODE_SPLITS") or 0)
        # Measurement switches (benchmarks/decode_kv_bench.py): a bfloat16 model's dots with
        # an fp8 cache in float16 (KV_F16, the default) or in bfloat16; the decode tile as
        # (keys per iteration, warps, stages) instead of launch_config's.
        self.fp8_dots_in_f16 = True
        self.decode_tile: tuple[int, int, int] | None = None
        # The decode grid's order. (KV heads, sequences), the default, runs one sequence's
        # heads side by side: they read the same cached token rows (a row holds every KV
        # head), so the reads in flight together are contiguous. (sequences, KV heads)
        # spreads them a batch apart, and on an H200 took 1-3% longer at 64-256 sequences
        # (benchmarks/decode_kv_bench.py, its grid orders; docs/benchmarks.md, "Decode attention's
        # grid order"). TPSERVE_DECODE_HEADS_FIRST=0 keeps the old order (A/B runs).
        self.decode_heads_first = os.environ.get("TPSERVE_DECODE_HEADS_FIRST", "1") != "0"
        # A decode step's rotary and cache write inside the decode launch (decode_new).
        # TPSERVE_DECODE_NEW_KV=0 launches them separately, as mixed steps do (A/B runs).
        self.decode_new_kv = os.environ.get("TPSERVE_DECODE_NEW_KV", "1") != "0"
        # The prefill tile as (rows, warps, stages) instead of launch_config's (rows: new
        # tokens x the GQA group; benchmarks/kernels_bench.py).
        self.prefill_tile: tuple[int, int, int] | None = None
        self._k = None

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
        on_cpu = device.type == "cpu" and interpreting()
        if device.type not in TRITON_TARGETS and not on_cpu:
            if importlib.util.find_spec("triton") is None:
                return "triton is not installed"
            return f"no CUDA or XPU device (this worker runs on {device.type})"
        missing = triton_missing("cpu" if on_cpu else device.type)
        if missing:
            return missing
        if dtype not in DTYPES:
            return f"dtype {dtype} is not supported (float16, bfloat16, float32)"
        if not MIN_HEAD_DIM <= spec.head_dim <= MAX_HEAD_DIM:
            return (f"head_dim {spec.head_dim} is not supported ({MIN_HEAD_DIM}..{MAX_HEAD_DIM}; "
                    "the torch backend takes any)")
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        group = spec.num_heads // spec.num_kv_heads
        rows, most_dims = MAX_WIDE_GROUP_TILE
        if group > MAX_GROUP and (group > rows or head_pad(spec.head_dim) > most_dims):
            return (f"{group} query heads per KV head of {spec.head_dim} dims do not fit one "
                    f"tile (up to {MAX_GROUP} heads, or {rows} heads of at most {most_dims} "
                    "dims; the torch backend takes any)")
        if spec.kv_cache_dtype == "fp8":
            reason = fp8_reason(device, on_cpu)
            if reason:
                return reason
        return unknown_feature_reason(spec, KNOWN_FIELDS, KNOWN_FEATURES)

    # --- launching ----------------------------------------------------------------------
    def _kernels(self):
        if self._k is None:
            configure_triton_cache()
            from tpserve.kernels import triton_kernels

            self._k = triton_kernels
        return self._k

    def _record(self, key: tuple) -> None:
        if key not in self.launched:
            if self.warmed and not self._warming:
                self.unplanned_launches += 1
                log.warning("triton: launch %s was not covered by warmup and compiles now", key)
            self.launched.add(key)

    def _common(self, q, k_cache, meta, spec, alibi_slopes, sinks=None):
        if q.stride(-1) != 1 or q.data_ptr() % 16:
            q = q.contiguous() if q.stride(-1) != 1 else q.clone()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Never read where the spec has none; a float32 tensor keeps the signature the same.
        dummy = self._dummy.get(q.device)
        if dummy is None:
            dummy = self._dummy[q.device] = torch.zeros(1, device=q.device)
        slopes = alibi_slopes if spec.alibi else dummy
        if spec.sinks and sinks is None:
            raise ValueError("triton: a spec with sinks needs the sinks= logits")
        # A float32 parameter passes as it is (no copy), so a captured graph reads the layer's.
        sinks = sinks.float().contiguous() if spec.sinks else dummy
        cfg = launch_config(q.dtype, spec)
        fp8 = spec.kv_cache_dtype == "fp8"
        if fp8 != kv_quant.is_fp8(k_cache):
            raise ValueError(f"triton: the spec's kv_cache_dtype {spec.kv_cache_dtype!r} does "
                             f"not match a {k_cache.dtype} cache")
        flags = dict(HAS_WINDOW=bool(spec.sliding_window), HAS_ALIBI=bool(spec.alibi),
                     HAS_SOFTCAP=bool(spec.softcap), HAS_SINKS=bool(spec.sinks),
                     HAS_CHUNK=bool(spec.attention_chunk), KV_FP8=fp8,
                     KV_F16=fp8 and q.dtype == torch.bfloat16 and self.fp8_dots_in_f16,
                     DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        # An fp8 cache's K scale folds into the score scale; V's scales the output.
        scale = float(spec.scale) * (float(spec.k_scale) if fp8 else 1.0)
        scalars = (scale, float(spec.softcap or 0.0), float(spec.v_scale) if fp8 else 1.0,
                   int(spec.sliding_window or 0), int(spec.attention_chunk or 0),
                   meta.block_tables.stride(0), q.stride(0), q.stride(1), out.stride(0),
                   out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        return q, out, (slopes.float().contiguous(), sinks), cfg, flags, scalars

    def num_splits(self, device: torch.device, batch: int, spec: AttentionSpec) -> int:
        """Context splits of a decode step (flash-decoding): enough (sequence, KV head, split)
        programs for two waves over the GPU's cores. A function of the batch size only, so a
        captured graph bucket keeps its split count for any context length; contexts too
        short for all splits leave the extra programs empty."""
        if self.forced_splits:
            return max(1, min(MAX_SPLITS, self.forced_splits))
        cores = self._cores.get(device)
        if cores is None:
            cores = self._cores[device] = compute_units(device)
        return max(1, min(MAX_SPLITS, -(-2 * cores // (batch * spec.num_kv_heads))))

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, sinks=None):
        q, out, tabs, cfg, flags, scalars = self._common(q, k_cache, meta, spec, alibi_slopes,
                                                         sinks)
        self._decode(out, q, k_cache, v_cache, _i32(meta.block_tables), _i32(meta.seq_lens),
                     tabs, cfg, flags, scalars, spec)
        return out

    def decode_new(self, q, k, v, rope, k_cache, v_cache, meta, spec, alibi_slopes=None,
                   sinks=None):
        """One launch (plus the split reduction) for a decode step from its raw projections:
        the decode kernel rotates q and the new keys, stores the new keys and values and
        attends (NEW_KV in paged_decode_kernel), where the base class launches the rotary +
        cache write first. TPSERVE_DECODE_NEW_KV=0 keeps the two launches (A/B runs)."""
        layout_ok = all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0 for x in (q, k, v))
        if not self.decode_new_kv or not layout_ok or q.shape[0] == 0:
            extra = {} if sinks is None else {"sinks": sinks}
            return super().decode_new(q, k, v, rope, k_cache, v_cache, meta, spec, alibi_slopes,
                                      **extra)
        q, out, tabs, cfg, flags, scalars = self._common(q, k_cache, meta, spec, alibi_slopes,
                                                         sinks)
        if rope is None:
            cos = sin = tabs[0]  # never read with ROT = 0
            rot = 0
        else:
            cos, sin = (x.contiguous() for x in rope)
            rot = cos.shape[-1]
        fp8 = spec.kv_cache_dtype == "fp8"
        new = (k, v, cos, sin, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0),
               v.stride(1), cos.stride(0), 1.0 / spec.k_scale if fp8 else 1.0,
               1.0 / spec.v_scale if fp8 else 1.0)
        self._decode(out, q, k_cache, v_cache, _i32(meta.block_tables), _i32(meta.seq_lens),
                     tabs, cfg, flags, scalars, spec, new=new, rot=rot)
        return out

    def _decode(self, out, q, k_cache, v_cache, tables, seq_lens, tabs, cfg, flags, scalars,
                spec, new: tuple | None = None, rot: int = 0) -> None:
        """The decode launch (and split reduction) for q's rows, one token per sequence.
        tabs: (ALiBi slopes, sinks) as _common gives them. new: the NEW_KV arguments of
        paged_decode_kernel (decode_new), rot its ROT."""
        slopes, sinks = tabs
        self._record(compile_key("decode", q.dtype, spec)
                     + (("new_kv", rot) if new is not None else ()))
        b, heads, d = q.shape
        new_kv = new is not None
        if not new_kv:  # never read
            new = (slopes,) * 5 + (0,) * 5 + (1.0, 1.0)
        splits = self.num_splits(q.device, b, spec)
        if splits > 1:
            part = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
            ml = torch.empty(b, heads, splits, 2, dtype=torch.float32, device=q.device)
        else:  # never read: one program per (sequence, KV head) writes out directly
            part = ml = slopes
        heads_first = self.decode_heads_first
        grid = (spec.num_kv_heads, b, splits) if heads_first else (b, spec.num_kv_heads, splits)
        self._kernels().paged_decode_kernel[grid](
            out, part, ml, q, k_cache, v_cache, tables, seq_lens,
            slopes, sinks, *scalars, splits, heads * splits * d, splits * d, *new,
            GROUP=spec.num_heads // spec.num_kv_heads, GROUP_PAD=cfg.group_pad,
            HEAD_DIM=d, HEAD_PAD=head_pad(d), BLOCK_SIZE=spec.block_size,
            **self._decode_launch(cfg), SPLIT=splits > 1, **flags, **pdl.launch(q.device, b),
            HEADS_FIRST=heads_first, NEW_KV=new_kv, ROT=rot)
        if splits > 1:
            self._reduce(out, part, ml, sinks if spec.sinks else None)

    def _decode_launch(self, cfg: LaunchConfig) -> dict:
        if self.decode_tile is None:
            return dict(BLOCK_N=cfg.decode_block_n, num_warps=cfg.num_warps,
                        num_stages=cfg.decode_stages)
        block_n, warps, stages = self.decode_tile
        return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    def _reduce(self, out: torch.Tensor, part: torch.Tensor, ml: torch.Tensor,
                sinks: torch.Tensor | None = None) -> None:
        """out [b, heads, d] from the splits' partial outputs part [b, heads, splits, d]
        and their (max, sum) ml [b, heads, splits, 2]; sinks (float32 [heads]) join the
        denominator here, once."""
        b, heads, splits, d = part.shape
        self._kernels().paged_decode_reduce_kernel[(b, heads)](
            out, part, ml, ml if sinks is None else sinks, splits, heads * splits * d,
            splits * d, out.stride(0), out.stride(1), HEAD_DIM=d, HEAD_PAD=head_pad(d),
            SPLITS_PAD=reduce_pad(splits), HAS_SINKS=sinks is not None,
            num_warps=4 if splits > 8 else 2, **pdl.launch(out.device, b))

    def prefill(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, sinks=None):
        q, out, tabs, cfg, flags, scalars = self._common(q, k_cache, meta, spec, alibi_slopes,
                                                         sinks)
        tables, seq_lens = _i32(meta.block_tables), _i32(meta.seq_lens)
        starts = _i32(meta.query_start_loc)
        # The decode rows at the head of a mixed step (the scheduler lists running sequences
        # first) go to the decode kernel: in a prefill tile one token fills GROUP of its
        # BLOCK_M rows, and a step that prefills 16 prompts of 256 tokens next to 240 decode
        # rows spent more of its attention time on those rows than on the prompts.
        nd = leading_decode_rows(meta.query_lens_host)
        if nd:
            self._decode(out[:nd], q[:nd], k_cache, v_cache, tables[:nd], seq_lens[:nd], tabs,
                         cfg, flags, scalars, spec)
        n = meta.num_seqs - nd
        if n == 0:
            return out
        self._record(compile_key("prefill", q.dtype, spec))
        rows, warps, stages = self.prefill_tile or (cfg.block_m, cfg.num_warps, cfg.num_stages)
        group = spec.num_heads // spec.num_kv_heads
        tokens = rows // group
        # The tile numbering of the kernel's docstring: nd decode rows hold one token each.
        programs = q.shape[0] // tokens + n - nd // tokens
        self._kernels().paged_prefill_kernel[(programs, spec.num_kv_heads)](
            out, q, k_cache, v_cache, tables[nd:], seq_lens[nd:], starts[nd:], *tabs, *scalars,
            n, GROUP=group, HEAD_DIM=spec.head_dim, HEAD_PAD=head_pad(spec.head_dim),
            BLOCK_SIZE=spec.block_size, BLOCK_M=rows, TOKENS=tokens, BLOCK_N=cfg.block_n, num_warps=warps, num_stages=stages, **flags)
        return out

    def rotary_write_kv(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, spec=None):
        """One launch for rotary on q and k plus the K/V cache write (fused_ops.py); an fp8
        cache is quantized with the spec's scales in the same launch."""
        self._record(("rotary", str(q.dtype), q.shape[1], k.shape[1], q.shape[2],
                      cos.shape[-1], str(k_cache.dtype)))
        scales = (spec.k_scale, spec.v_scale) if spec is not None else (1.0, 1.0)
        return rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                      *scales)

    # --- compiling ----------------------------------------------------------------------
    def compile_count(self) -> int:
        """Kernel variants built in this process, the fused layer, sampling and quantized
        matmul kernels included (warmup launches them too). Under the interpreter there is
        no compiler, so the distinct launch keys stand in for it."""
        if interpreting():
            return len(self.launched)
        from tpserve.kernels import triton_fused, triton_sampling

        kernels = self._kernels().KERNELS + triton_fused.KERNELS + triton_sampling.KERNELS
        quant = sys.modules.get("tpserve.kernels.quant.triton_jit")
        if quant is not None:  # the quantized matmuls, where a layer uses them
            kernels += quant.KERNELS
        dense = sys.modules.get("tpserve.kernels.triton_gemv")
        if dense is not None:  # the one-row GEMV, where warmup timed it
            kernels += dense.KERNELS
        total = 0
        for kernel in kernels:
            caches = getattr(kernel, "device_caches", {}) or {}
            total += sum(len(c[0]) for c in caches.values())
        return total

    def warmup(self, device: torch.device, dtype: torch.dtype, spec: AttentionSpec,
               batch_sizes: tuple[int, ...] = (1,)) -> None:
        t0 = time.perf_counter()
        cache_dir = configure_triton_cache()
        before, on_disk = self.compile_count(), cached_kernel_count(cache_dir)
        plan = warmup_plan(dtype, spec, batch_sizes)
        self._warming = True
        try:
            for case in plan:
                self._run_case(case, device, dtype, spec)
            self._warm_reductions(device, dtype, spec)
            # The fused norm / activation kernels of the layers built in this process.
            fused_ops.warmup(device, dtype)
        finally:
            self._warming = False
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)
        report = WarmupReport(
            seconds=time.perf_counter() - t0, variants=self.compile_count() - before,
            compiled_from_source=cached_kernel_count(cache_dir) - on_disk, cases=len(plan),
            keys=sorted({c.key for c in plan}))
        self.reports.append(report)
        self.warmed = True
        sizes = ",".join(map(str, sorted(set(batch_sizes))))
        if interpreting():
            log.info("triton warmup under the interpreter (nothing to compile): %d step shapes "
                     "(batch sizes %s) in %.2fs", report.cases, sizes, report.seconds)
            return
        log.info("triton warmup: %d kernel variant(s), %d compiled from source, the rest "
                 "loaded from %s; %d step shapes (batch sizes %s) in %.2fs", report.variants,
                 report.compiled_from_source, cache_dir, report.cases, sizes, report.seconds)

    def _warm_reductions(self, device, dtype, spec: AttentionSpec) -> None:
        """Every variant of the split reduction a decode step can pick (the split count
        depends on the batch and the device's core count, not only on the buckets)."""
        d, heads = spec.head_dim, spec.num_heads
        sinks = torch.zeros(heads, device=device) if spec.sinks else None
        for b in (1, pdl.MAX_ROWS + 1):  # a few sequences and many (kernels/pdl.py)
            out = torch.empty(b, heads, d, dtype=dtype, device=device)
            splits = 2
            while splits <= reduce_pad(MAX_SPLITS):
                self._reduce(out, torch.zeros(b, heads, splits, d, dtype=torch.float32,
                                              device=device),
                             torch.zeros(b, heads, splits, 2, dtype=torch.float32,
                                         device=device), sinks)
                splits *= 2

    def _run_case(self, case: WarmupCase, device, dtype, spec: AttentionSpec) -> None:
        bs = spec.block_size
        nblk = [-(-s // bs) for s in case.seq_lens]
        width = max(nblk)
        # Reversed block ids: warmup also exercises non-contiguous tables.
        ids = list(range(sum(nblk)))[::-1]
        tables, at = [], 0
        for n in nblk:
            tables.append(ids[at : at + n] + [0] * (width - n))
            at += n
        shape = self.kv_cache_shape(len(ids), spec)
        kv_dtype = kv_quant.cache_dtype(spec.kv_cache_dtype, dtype)
        k_cache = torch.randn(shape, dtype=dtype, device=device).to(kv_dtype)
        v_cache = torch.randn(shape, dtype=dtype, device=device).to(kv_dtype)
        starts = [0]
        for n in case.query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(starts[-1], dtype=torch.long, device=device),
            max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
            query_lens_host=case.query_lens, seq_lens_host=case.seq_lens)
        q = torch.randn(starts[-1], spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        slopes = torch.rand(spec.num_heads, device=device) if spec.alibi else None
        # The sinks' values are not part of the compile key; passing them is (HAS_SINKS).
        sinks = {"sinks": torch.randn(spec.num_heads, device=device)} if spec.sinks else {}
        run = self.decode if case.kind == "decode" else self.prefill
        run(q, k_cache, v_cache, meta, spec, slopes, **sinks)
        # The rotary widths of the models built here (RotaryEmbedding plans them; none for
        # ALiBi models such as Bloom): the rotary launches specialise on the width.
        widths = [] if spec.alibi else fused_ops.planned_rotary_dims(spec.head_dim)
        t = q.shape[0]
        kv = torch.randn(t, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        if case.kind == "decode" and self.decode_new_kv:
            # decode_new: 0, no rotary (ALiBi, learned positions, Cohere 2's full layers)
            unrotated = [0] if not widths or fused_ops.planned_unrotated() else []
            for width in widths + unrotated:
                cs = torch.randn(t, width, dtype=dtype, device=device)
                self.decode_new(q, kv, kv, (cs, cs) if width else None, k_cache, v_cache,
                                meta, spec, slopes, **sinks)
        if case.kind == "prefill":  # the fused rotary + cache write of prompts
            extra = {"spec": spec} if spec.kv_cache_dtype != "auto" else {}
            for width in widths or [spec.head_dim]:
                cs = torch.randn(t, width, dtype=dtype, device=device)
                self.rotary_write_kv(q, kv, kv, cs, cs, k_cache, v_cache, meta.slot_mapping,
                                     **extra)
                # and a decode row's launch (another variant where PDL is on, kernels/pdl.py)
                self.rotary_write_kv(q[:1], kv[:1], kv[:1], cs[:1], cs[:1], k_cache, v_cache,
                                     meta.slot_mapping[:1], **extra)


def fp8_reason(device: torch.device, on_cpu: bool) -> str | None:
    """Why the kernels cannot use an fp8 cache on `device`, or None. Triton converts e4m3
    (fp8e4nv) on NVIDIA GPUs of compute capability 8.9 and later (Ada, Hopper, Blackwell);
    the interpreter emulates it."""
    if kv_quant.FP8_DTYPE is None:
        return kv_quant.fp8_missing()
    if on_cpu:
        return None
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (f"an fp8 KV cache needs compute capability 8.9 or later in Triton (this GPU "
                    f"is {cap[0]}.{cap[1]}); the torch backend reads it anywhere, slower")
        return None
    return f"an fp8 KV cache on {device.type} is not supported by the Triton kernels here"


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)
