"""The conformance suite every attention backend must pass: `run_conformance(name, device,
dtype)`.

Random shapes, random block tables with holes (unused and non-contiguous block ids, padding
entries pointing at garbage), mixed prefill + decode steps (in any order, and with the decode
rows first as the scheduler orders them), decode-only steps and decode steps
of a few long contexts (160-700 keys: several split-K programs per sequence), sliding
windows, ALiBi, GQA/MQA and softcap; FEATURE_CONFIGS adds attention sinks and chunked
attention (chunks shorter than the contexts, so every kind of step crosses them). The backend under test fills its own cache layout
through its own write_kv; its output is compared with the torch reference backend run in
float64 on the CPU over the same (dtype-rounded) inputs, so only the kernel's arithmetic
error is measured. Cache slots no sequence owns hold large finite garbage: a kernel that
reads the wrong slot fails loudly, and the float64 reference (whose masked probabilities are
exactly zero) stays finite.

An fp8 KV cache (`kv_cache_dtype="fp8"`) is checked twice per step. (1) The kernel against
the float64 reference reading the *same* fp8 values (the reference quantizes the same
dtype-rounded inputs with kv_quant.quantize, so a backend whose write differs by a bit shows
too): the dtype's own tolerance, as for a float cache. (2) The fp8 output against the
full-precision reference over the unquantized cache: FP8_TOLERANCE, derived below.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

import torch

from tpserve.kernels import kv_quant
from tpserve.kernels.base import AttentionMetadata, AttentionSpec
from tpserve.kernels.fused_ops import apply_rotary_torch
from tpserve.kernels.registry import load_backend_class
from tpserve.kernels.torch_backend import TorchAttentionBackend

# Largest error allowed, relative to the largest reference value of the step.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 1e-2,
             torch.bfloat16: 1e-2}
GARBAGE = 1.0e4
# fp8 vs full precision. e4m3 keeps 3 mantissa bits: a stored value is off by at most
# u = 2^-4 of itself (round to nearest). V's errors reach the output through a convex
# combination of rows, so at most u of the largest |v|. K's errors move each score by
# scale * q.dk: for the unit-normal q and k here about u / sqrt(3) = 0.036 per standard
# deviation, up to ~0.11 at three, which the softmax turns into a relative change of the
# weights of up to e^0.11 - 1 = 0.12. Added: ~u + 0.12 ~ 0.18 at worst, measured against
# max|reference output| (which a softmax average over a long context makes smaller than
# max|v|, so the ratio can only grow there). 4u = 2^-2 covers that; measured on the CPU
# (torch backend, float32 and bfloat16, scales 1/1 and 0.3/2.5, 384 steps): worst 0.108.
# This check bounds the accuracy trade-off; the tight check against the same fp8 cache is
# what catches a wrong kernel (a dropped scale, a different rounding, a wrong block).
FP8_TOLERANCE = 2.0**-2
STEP_KINDS = ("mixed", "decode", "long decode", "decode-led mixed", "verification",
              "decode, new kv", "long decode, new kv")

# Feature configurations: (name, heads, kv_heads, window, alibi, softcap).
CONFIGS = [
    ("mha", 4, 4, None, False, None),
    ("gqa", 8, 2, None, False, None),
    ("mqa", 8, 1, None, False, None),
    ("window", 4, 2, 11, False, None),
    ("alibi", 8, 8, None, True, None),
    ("alibi_gqa", 8, 2, None, True, None),
    ("softcap", 4, 2, None, False, 2.0),
    ("all", 8, 2, 7, True, 2.0),
]
# Groups of query heads per KV head that are not powers of two (Qwen2.5: 5, 6 and 7;
# Falcon 7B: 71 on one KV head): the Triton tiles pad a group to a power of two.
ODD_GROUP_CONFIGS = [
    ("gqa7", 14, 2, None, False, None),
    ("mqa5_window", 5, 1, 11, False, None),
    ("mqa71", 71, 1, None, False, None),  # a 128-row decode tile, one token per prefill tile
]
# Features only some backends have, each with the AttentionSpec fields it sets: gpt-oss's
# sinks (with its sliding window too), Llama 4's chunks (12 and 20: not multiples of either
# block size, shorter than one key tile), and everything at once.
FEATURE_CONFIGS = [
    ("sinks", 8, 2, None, False, None, {"sinks": True}),
    ("sinks_window", 4, 1, 11, False, None, {"sinks": True}),
    ("chunked", 8, 2, None, False, None, {"attention_chunk": 12}),
    ("chunked_window", 4, 4, 7, False, None, {"attention_chunk": 20}),
    ("sinks_chunked_all", 8, 2, 11, True, 2.0, {"sinks": True, "attention_chunk": 16}),
]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper (power-of-two head counts)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])


@dataclass
class CaseResult:
    name: str
    step: str  # one of STEP_KINDS
    max_rel_err: float
    ok: bool
    detail: str = ""
    fp8_vs_full: float | None = None  # fp8 cache: error against the unquantized reference


@dataclass
class ConformanceResult:
    backend: str
    device: str
    dtype: str
    cases: list[CaseResult] = field(default_factory=list)
    declined: dict[str, str] = field(default_factory=dict)  # case name -> backend's reason

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    @property
    def worst_fp8_vs_full(self) -> float | None:
        errs = [c.fp8_vs_full for c in self.cases if c.fp8_vs_full is not None]
        return max(errs) if errs else None

    def summary(self) -> str:
        worst = max((c.max_rel_err for c in self.cases), default=float("nan"))
        fp8 = self.worst_fp8_vs_full
        return (f"{self.backend} on {self.device} {self.dtype}: {len(self.cases)} steps, "
                f"{len(self.failures)} failed, worst relative error {worst:.2e}"
                + (f", worst fp8 vs full precision {fp8:.2e}" if fp8 is not None else "")
                + f", {len(self.declined)} configurations declined")


@dataclass
class _Step:
    query_lens: list[int]
    seq_lens: list[int]
    # Decode through backend.decode_new: q and the newest key arrive unrotated (rotary of
    # rot_dims, 0: none) and the newest keys and values are not in the cache yet.
    new_kv: bool = False
    rot_dims: int = 0


def _random_steps(rng: random.Random, block_size: int, spec: AttentionSpec) -> list[_Step]:
    """A mixed step (fresh prompts, chunked prefills, decodes), decode-only steps of short
    and long contexts, a decode-led mixed step, a step of short rows over cached context
    (speculative verification), and the two decode steps again through
    decode_new (rotary over all or half of head_dim; none with ALiBi, as Bloom)."""
    mixed_q, mixed_ctx = [], []
    for kind in ["prompt", "chunk", "decode", rng.choice(["prompt", "chunk", "decode"])]:
        ctx = rng.randint(2, 5 * block_size + 7)
        q = {"prompt": ctx, "chunk": rng.randint(2, ctx), "decode": 1}[kind]
        mixed_q.append(q)
        mixed_ctx.append(ctx)
    order = list(range(len(mixed_q)))
    rng.shuffle(order)
    mixed = _Step([mixed_q[i] for i in order], [mixed_ctx[i] for i in order])
    n = rng.randint(1, 6)
    decode = _Step([1] * n, [rng.randint(1, 6 * block_size + 3) for _ in range(n)])
    # Long contexts with few sequences: what split-K decode cuts into several programs.
    n = rng.randint(1, 3)
    long = _Step([1] * n, [rng.randint(160, 700) for _ in range(n)])
    # Decode rows first, as the scheduler orders a step (running sequences, then new
    # prompts): the Triton backend sends the leading decode rows to its decode kernel and
    # the rest, from a query_start offset, to its prefill kernel.
    lead = rng.randint(1, 3)
    prompt = rng.randint(2, 5 * block_size + 7)
    chunk_ctx = rng.randint(3, 5 * block_size + 7)
    led = _Step([1] * lead + [prompt, rng.randint(2, chunk_ctx), 1],
                [rng.randint(1, 6 * block_size + 3) for _ in range(lead)]
                + [prompt, chunk_ctx, rng.randint(1, 4 * block_size)])
    # Speculative verification: a few rows of 2-17 tokens (a token and its drafts) over
    # cached context, beside a decode row.
    n = rng.randint(2, 4)
    ctxs = [rng.randint(18, 6 * block_size + 3) for _ in range(n)]
    verify = _Step([rng.randint(2, 17) for _ in range(n)] + [1], ctxs + [rng.randint(1, 40)])
    rot = 0 if spec.alibi else rng.choice((spec.head_dim, spec.head_dim // 2))
    return [mixed, decode, long, led, verify, replace(decode, new_kv=True, rot_dims=rot),
            replace(long, new_kv=True, rot_dims=rot)]


def _layout(rng: random.Random, step: _Step, block_size: int):
    """Block tables drawn without replacement from a pool twice the size needed: holes,
    non-contiguous ids, and padding entries that point at blocks other sequences own."""
    need = [-(-s // block_size) for s in step.seq_lens]
    num_blocks = 2 * sum(need) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    width = max(need) + rng.randint(0, 2)
    tables, at = [], 0
    for n in need:
        row = pool[at : at + n]
        at += n
        tables.append(row + [rng.randrange(num_blocks) for _ in range(width - n)])
    return num_blocks, tables


def _one_step(backend, spec: AttentionSpec, step: _Step, device, dtype, gen: torch.Generator,
              rng: random.Random, slopes: torch.Tensor | None, sinks: torch.Tensor | None = None):
    """(output, float64 reference, fp8: reference over the unquantized cache, new-kv steps:
    the error of a plain decode over the cache decode_new left). sinks: float32 [heads]
    for a spec with sinks, passed to both sides as they are."""
    bs = spec.block_size
    num_blocks, tables = _layout(rng, step, bs)
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    total_ctx = sum(step.seq_lens)
    # Inputs in float64, rounded through the tested dtype so both sides see the same values.
    k_all = torch.randn(total_ctx, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    v_all = torch.randn(total_ctx, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    n_q = sum(step.query_lens)
    q = torch.randn(n_q, hq, d, generator=gen, dtype=torch.float64).to(dtype)
    if spec.softcap:
        q = (q.double() * 3.0).to(dtype)  # scores large enough for the cap to bend them
    slots = []
    for row, ctx in zip(tables, step.seq_lens, strict=True):
        slots.extend(row[p // bs] * bs + p % bs for p in range(ctx))
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    starts = [0]
    for n in step.query_lens:
        starts.append(starts[-1] + n)
    rope = None
    q_ref, k_ref = q, k_all
    if step.new_kv:
        # The newest key of each sequence is its last position; the reference rotates it
        # and q in the tested dtype (the torch rotary), then sees the same values.
        newest = torch.cumsum(torch.tensor(step.seq_lens), 0) - 1
        if step.rot_dims:
            pos = torch.tensor(step.seq_lens, dtype=torch.float64) - 1
            inv = 1.0 / 10000.0 ** (torch.arange(0, step.rot_dims, 2, dtype=torch.float64)
                                    / step.rot_dims)
            ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
            rope = (ang.cos().to(dtype), ang.sin().to(dtype))
            q_ref = apply_rotary_torch(q, *rope)
            k_ref = k_all.clone()
            k_ref[newest] = apply_rotary_torch(k_all[newest], *rope)

    def meta_on(dev, slot_map=slot_mapping):
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=slot_map.to(dev), max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens), query_lens_host=tuple(step.query_lens),
            seq_lens_host=tuple(step.seq_lens))

    # The reference: torch backend, float64, CPU, standard layout.
    ref_backend = TorchAttentionBackend()
    fp8 = spec.kv_cache_dtype == "fp8"
    extra = {"spec": spec} if fp8 else {}
    cache_dtype = kv_quant.cache_dtype(spec.kv_cache_dtype, torch.float64)
    full_spec = replace(spec, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    ref_slopes = None if slopes is None else slopes.double()
    ref_sinks = {} if sinks is None else {"sinks": sinks}
    dev_sinks = {} if sinks is None else {"sinks": sinks.to(device)}
    shape = ref_backend.kv_cache_shape(num_blocks, spec)
    kc, vc = _garbage(shape, cache_dtype, "cpu")
    ref_backend.write_kv(k_ref.double(), v_all.double(), kc, vc, slot_mapping, **extra)
    ref = ref_backend.forward(q_ref.double(), kc, vc, meta_on("cpu"), spec, ref_slopes,
                              **ref_sinks)
    full = None
    if fp8:  # the same step over the unquantized cache
        kc, vc = _garbage(shape, torch.float64, "cpu")
        ref_backend.write_kv(k_ref.double(), v_all.double(), kc, vc, slot_mapping)
        full = ref_backend.forward(q_ref.double(), kc, vc, meta_on("cpu"), full_spec,
                                   ref_slopes, **ref_sinks)

    # The backend under test: its own layout and write_kv, on its device.
    shape = backend.kv_cache_shape(num_blocks, spec)
    kc, vc = _garbage(shape, kv_quant.cache_dtype(spec.kv_cache_dtype, dtype), device)
    dev_slopes = None if slopes is None else slopes.float().to(device)
    if not step.new_kv:
        meta = meta_on(device)
        backend.write_kv(k_all.to(device), v_all.to(device), kc, vc, meta.slot_mapping,
                         **extra)
        out = backend.forward(q.to(device), kc, vc, meta, spec, dev_slopes, **dev_sinks)
        return out.detach().cpu(), ref, full, None
    # Every key but the newest in the cache (theirs stay garbage until decode_new), and the
    # newest handed over as views of one projection row, as a model's qkv output.
    old = torch.ones(total_ctx, dtype=torch.bool)
    old[newest] = False
    backend.write_kv(k_all[old].to(device), v_all[old].to(device), kc, vc,
                     slot_mapping[old].to(device), **extra)
    qkv = torch.cat([q.flatten(1), k_all[newest].flatten(1), v_all[newest].flatten(1)], 1)
    qkv = qkv.to(device)
    q_in, k_in, v_in = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    meta = meta_on(device, slot_mapping[newest])
    out = backend.decode_new(q_in.view(-1, hq, d), k_in.view(-1, hkv, d),
                             v_in.view(-1, hkv, d),
                             None if rope is None else tuple(x.to(device) for x in rope),
                             kc, vc, meta, spec, dev_slopes, **dev_sinks)
    # What decode_new stored, read back through the backend's own layout: the same step
    # again, the plain way, with the reference's rotated q over the cache it left.
    again = backend.forward(q_ref.to(device), kc, vc, meta, spec, dev_slopes, **dev_sinks)
    return out.detach().cpu(), ref, full, _rel_err(again.detach().cpu(), ref)


def _garbage(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches whose every slot holds +-GARBAGE (an fp8 cache: its largest value)."""
    k = torch.full(shape, GARBAGE, device=device)
    if dtype == kv_quant.FP8_DTYPE:
        return kv_quant.quantize(k, 1.0), kv_quant.quantize(-k, 1.0)
    return k.to(dtype), (-k).to(dtype)


def run_conformance(backend_name: str | type, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, *, head_dims: tuple[int, ...] = (64, 128),
                    block_sizes: tuple[int, ...] = (4, 16), seed: int = 0,
                    required: tuple[str, ...] = ("mha", "gqa", "mqa"),
                    raise_on_failure: bool = True, kv_cache_dtype: str = "auto",
                    kv_scales: tuple[float, float] = (1.0, 1.0),
                    configs: list[tuple] = CONFIGS) -> ConformanceResult:
    """Run every configuration (of `configs`: CONFIGS, FEATURE_CONFIGS or a selection) x
    head_dim x block_size through `backend_name` (a registry name, or an AttentionBackend
    class) and compare with the float64 reference. A configuration the backend declines through supports() is
    recorded with its reason; declining one named in `required` is a failure.
    kv_cache_dtype="fp8": an e4m3 cache with (k_scale, v_scale) = kv_scales, checked as the
    module docstring says."""
    device = torch.device(device)
    cls = load_backend_class(backend_name) if isinstance(backend_name, str) else backend_name
    backend = cls()
    label_dtype = str(dtype).replace("torch.", "")
    if kv_cache_dtype == "fp8":
        label_dtype += f" fp8 cache (scales {kv_scales[0]:g}, {kv_scales[1]:g})"
    result = ConformanceResult(getattr(cls, "name", str(cls)), str(device), label_dtype)
    tol = TOLERANCE[dtype]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for name, hq, hkv, window, alibi, softcap, *more in configs:
        fields = more[0] if more else {}
        for d in head_dims:
            for bs in block_sizes:
                spec = AttentionSpec(num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                     scale=1.0 / math.sqrt(d), sliding_window=window,
                                     alibi=alibi, softcap=softcap, block_size=bs,
                                     kv_cache_dtype=kv_cache_dtype, k_scale=kv_scales[0],
                                     v_scale=kv_scales[1], **fields)
                label = f"{name} d={d} block={bs}"
                reason = _why_not(cls, device, dtype, spec)
                if reason:
                    result.declined[label] = reason
                    if name in required:
                        result.cases.append(CaseResult(label, "-", math.inf, False,
                                                       f"declined: {reason}"))
                    continue
                slopes = alibi_slopes(hq) if alibi else None
                # Sinks of the size of a few scores: each takes a visible share of the
                # denominator without drowning the keys.
                sinks = (torch.randn(hq, generator=gen) * 2.0).float() if spec.sinks else None
                for step, kind in zip(_random_steps(rng, bs, spec), STEP_KINDS, strict=True):
                    result.cases.append(_check(backend, spec, step, kind, label, device, dtype,
                                               gen, rng, slopes, tol, sinks))
    if raise_on_failure:
        bad = result.failures
        assert not bad, result.summary() + "\n" + "\n".join(
            f"  {c.name} [{c.step}]: {c.detail or f'relative error {c.max_rel_err:.3e}'}"
            for c in bad)
    return result


def _why_not(cls, device, dtype, spec) -> str | None:
    """The registry's check (an fp8 cache needs fp8_kv_cache = True), then supports()."""
    if spec.kv_cache_dtype != "auto" and not getattr(cls, "fp8_kv_cache", False):
        return kv_quant.fp8_refusal(getattr(cls, "name", None))
    return cls.supports(device, dtype, spec)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _check(backend, spec, step, kind, label, device, dtype, gen, rng, slopes,
           tol, sinks=None) -> CaseResult:
    try:
        out, ref, full, cache_err = _one_step(backend, spec, step, device, dtype, gen, rng,
                                              slopes, sinks)
    except Exception as exc:  # noqa: BLE001 - a crash is a failed case, reported with the rest
        return CaseResult(label, kind, math.inf, False, f"{type(exc).__name__}: {exc}")
    if out.shape != ref.shape:
        return CaseResult(label, kind, math.inf, False, f"shape {tuple(out.shape)} != "
                          f"{tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return CaseResult(label, kind, math.inf, False, "non-finite output")
    err = _rel_err(out, ref)
    where = f"(q_lens {step.query_lens}, seq_lens {step.seq_lens})"
    detail = "" if err <= tol else f"relative error {err:.3e} > {tol:g} {where}"
    if cache_err is not None and cache_err > tol:
        detail = (f"{detail + '; ' if detail else ''}a decode over the cache it wrote: "
                  f"relative error {cache_err:.3e} > {tol:g} {where}")
    fp8_err = None if full is None else _rel_err(out, full)
    if fp8_err is not None and fp8_err > FP8_TOLERANCE:
        detail += (f"{'; ' if detail else ''}fp8 against full precision: relative error "
                   f"{fp8_err:.3e} > {FP8_TOLERANCE:g} {where}")
    return CaseResult(label, kind, err, not detail, detail, fp8_err)


def as_markdown(results: list[ConformanceResult]) -> str:
    """One table row per backend/dtype, then every declined configuration."""
    lines = ["| backend | device | dtype | steps | failed | worst relative error | declined |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        worst = max((c.max_rel_err for c in r.cases), default=float("nan"))
        lines.append(f"| {r.backend} | {r.device} | {r.dtype} | {len(r.cases)} | "
                     f"{len(r.failures)} | {worst:.2e} | {len(r.declined)} |")
    notes = [f"- {r.backend} {r.dtype}: worst fp8 against full precision "
             f"{r.worst_fp8_vs_full:.2e} (tolerance {FP8_TOLERANCE:g})"
             for r in results if r.worst_fp8_vs_full is not None]
    notes += [f"- {r.backend} {r.dtype} declined {label}: {reason}"
              for r in results for label, reason in r.declined.items()]
    notes += [f"- {r.backend} {r.dtype} FAILED {c.name} [{c.step}]: {c.detail}"
              for r in results for c in r.failures]
    return "\n".join(lines + ([""] + notes if notes else []))


__all__ = ["CONFIGS", "FEATURE_CONFIGS", "ConformanceResult", "as_markdown", "run_conformance"]


def main() -> int:
    """python tests/kernels/conformance.py --device cuda --backends torch,triton ... --out f.md"""
    import argparse
    import datetime
    import platform

    ap = argparse.ArgumentParser(description="attention backend conformance suite")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="torch")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--block-sizes", default="4,16")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="auto, fp8 or auto,fp8")
    ap.add_argument("--configs", default="base", choices=["base", "features", "all"],
                    help="CONFIGS, FEATURE_CONFIGS (sinks, chunked) or both")
    ap.add_argument("--out")
    args = ap.parse_args()
    configs = {"base": CONFIGS, "features": FEATURE_CONFIGS,
               "all": CONFIGS + FEATURE_CONFIGS}[args.configs]
    results = []
    for name in args.backends.split(","):
        for dt in args.dtypes.split(","):
            for kv in args.kv_cache_dtypes.split(","):
                r = run_conformance(name, args.device, getattr(torch, dt),
                                    head_dims=tuple(int(x) for x in args.head_dims.split(",")),
                                    block_sizes=tuple(int(x) for x in
                                                      args.block_sizes.split(",")),
                                    raise_on_failure=False, kv_cache_dtype=kv,
                                    configs=configs)
                print(r.summary(), flush=True)
                results.append(r)
    dev = torch.device(args.device)
    machine = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
               else platform.processor() or platform.machine())
    header = (f"{datetime.date.today()}, {machine}, torch {torch.__version__}; head_dims "
              f"{args.head_dims}, block sizes {args.block_sizes}, configs {args.configs}\n\n")
    text = header + as_markdown(results) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
