"""Conformance of the fused layer kernels (tpserve/kernels/triton_fused.py) against their torch
reference (tpserve/kernels/fused_ops.py): `run_fused_conformance(device, dtypes, head_dims)`.

Cases: residual add + RMSNorm (Llama's cast-first and Gemma's (1 + w) in float32, with and
without a residual, hidden sizes that are and are not powers of two), silu-and-mul and
gelu-tanh-and-mul, and rotary + paged KV write for MHA, GQA and MQA, full and partial rotary,
with non-contiguous cache slots (holes, unwritten slots must stay untouched).

The error of a case is max |kernel - reference| / max |reference|. Both paths round to the
model dtype at the same points, so on a GPU the kernels agree to about one unit in the last
place; Triton's CPU interpreter converts to bfloat16 by truncation, hence the bfloat16 margin.

rotary_write_kv into an fp8 (e4m3) cache, with per-tensor scales 0.3 (K) and 2.5 (V) and
inputs large enough that some values saturate at +-448: the reference is kv_quant.quantize of
the torch path's rotated keys and values. Both round the same model-dtype values to nearest,
so they store the same bytes; FP8_TOLERANCE (one e4m3 step, 2^-3 of the largest value) leaves
room only for a model-dtype rounding that differs (the interpreter's bfloat16 truncation).
Triton 3.6's interpreter emulates float32 -> e4m3 with two faults of its own (a one-line
store kernel shows both): it drops the carry when rounding up across a power of two (127.0
is stored as 64, not 128) and it rounds ties away from zero (116 -> 120, not 112). Under
TRITON_INTERPRET=1, and only there, a stored value of exactly half a power-of-two reference
counts as the first; the second stays within one e4m3 step. On a GPU the conversion is the
hardware's round-to-nearest-even, as torch's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.kernels import fused_ops as fo
from tpserve.kernels import kv_quant

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FP8_TOLERANCE = 2.0**-3
FP8_SCALES = (0.3, 2.5)


@dataclass
class FusedCase:
    kernel: str
    dtype: str
    shape: str
    max_rel_err: float
    ok: bool


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    return (out.double() - ref.double()).abs().max().item() / max(
        ref.double().abs().max().item(), 1e-30)


def _norm_cases(device, dtype, gen):
    for hidden in (96, 2048, 3072):
        for offset, cast_first, label in ((0.0, True, "llama"), (1.0, False, "gemma")):
            for with_res in (False, True):
                x = torch.randn(7, hidden, generator=gen).to(device, dtype)
                r = torch.randn(7, hidden, generator=gen).to(device, dtype) if with_res else None
                w = (torch.randn(hidden, generator=gen) * 0.5).to(device, dtype)
                ref = fo.add_rms_norm_torch(x, r, w, 1e-6, offset, cast_first)
                out = fo.add_rms_norm_triton(x, r, w, 1e-6, offset, cast_first)
                err = max(_err(out[0], ref[0]), _err(out[1], ref[1]))
                name = f"add_rms_norm[{label}{'+res' if with_res else ''}]"
                yield name, f"7x{hidden}", err


def _act_cases(device, dtype, gen):
    acts = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}
    for name, act in acts.items():
        for inter in (80, 1536, 5632):
            x = (torch.randn(5, 2 * inter, generator=gen) * 2).to(device, dtype)
            err = _err(fo.gated_act_triton(x, fo.GATED_ACTS[name]), fo.gated_act_torch(x, act))
            yield f"{name}_and_mul", f"5x{inter}", err


def _rotary_cases(device, dtype, gen, head_dims):
    for d in head_dims:
        for heads, kv_heads in ((4, 4), (8, 2), (8, 1)):
            for rot in (d, d // 2):
                t, block, blocks = 6, 4, 8
                qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(device, dtype)
                q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
                q, k, v = (x.view(t, -1, d) for x in (q, k, v))
                ang = torch.rand(t, rot // 2, generator=gen) * 100
                cos = torch.cat([ang.cos()] * 2, -1).to(device, dtype)
                sin = torch.cat([ang.sin()] * 2, -1).to(device, dtype)
                slots = torch.randperm(blocks * block, generator=gen)[:t].to(device)
                caches = [torch.full((blocks, block, kv_heads, d), 7.0, dtype=dtype,
                                     device=device) for _ in range(4)]
                k_ref, v_ref, k_out, v_out = caches
                k_ref.view(-1, kv_heads, d)[slots] = fo.apply_rotary_torch(k, cos, sin)
                v_ref.view(-1, kv_heads, d)[slots] = v
                q_ref = fo.apply_rotary_torch(q, cos, sin)
                # One head per program (a few tokens) and blocks of 4 heads (many tokens;
                # a KV block of 2 or 1 heads is partly masked).
                err = 0.0
                for hb in (1, 4):
                    k_out.fill_(7.0)
                    v_out.fill_(7.0)
                    q_out = fo.rotary_write_kv_triton(q, k, v, cos, sin, k_out, v_out, slots,
                                                      heads_per_program=hb)
                    err = max(err, _err(q_out, q_ref), _err(k_out, k_ref), _err(v_out, v_ref))
                yield "rotary_write_kv", f"d{d} h{heads}/{kv_heads} rot{rot}", err
                if kv_quant.FP8_DTYPE is None:
                    continue
                # The same step into an e4m3 cache; x200 saturates some values at +-448.
                k8, v8 = (k * 200).to(dtype), v * 200
                ks, vs = FP8_SCALES
                caches = [kv_quant.quantize(torch.full((blocks, block, kv_heads, d), 7.0,
                                                       device=device), 1.0) for _ in range(4)]
                k_ref, v_ref, k_out, v_out = caches
                k_ref.view(-1, kv_heads, d)[slots] = kv_quant.quantize(
                    fo.apply_rotary_torch(k8, cos, sin), ks)
                v_ref.view(-1, kv_heads, d)[slots] = kv_quant.quantize(v8, vs)
                q_out = fo.rotary_write_kv_triton(q, k8, v8, cos, sin, k_out, v_out, slots,
                                                  ks, vs, heads_per_program=1 if rot == d else 4)
                err = max(_err(q_out, q_ref), _fp8_err(k_out, k_ref), _fp8_err(v_out, v_ref))
                yield "rotary_write_kv[fp8]", f"d{d} h{heads}/{kv_heads} rot{rot}", err


def _fp8_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """_err of two e4m3 caches, forgiving the interpreter's lost carry (module docstring)."""
    out, ref = out.float(), ref.float()
    if os.environ.get("TRITON_INTERPRET") == "1":
        mant, _ = torch.frexp(ref)
        lost_carry = (out * 2 == ref) & (mant.abs() == 0.5)
        out = torch.where(lost_carry, ref, out)
    return _err(out, ref)


def run_fused_conformance(device: str = "cpu", dtypes=(torch.float32,),
                          head_dims=(64, 128, 256)) -> list[FusedCase]:
    dev = torch.device(device)
    cases = []
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(0)
        tol = TOLERANCE[dtype]
        for gen_cases in (_norm_cases(dev, dtype, gen), _act_cases(dev, dtype, gen),
                          _rotary_cases(dev, dtype, gen, head_dims)):
            for name, shape, err in gen_cases:
                limit = FP8_TOLERANCE if "[fp8]" in name else tol
                cases.append(FusedCase(name, str(dtype).removeprefix("torch."), shape, err,
                                       err <= limit))
    return cases


def as_markdown(cases: list[FusedCase]) -> str:
    """One row per (kernel, dtype): cases, failures, worst error; then each failure."""
    lines = ["| fused kernel | dtype | cases | failed | worst relative error |",
             "| --- | --- | --- | --- | --- |"]
    groups: dict[tuple[str, str], list[FusedCase]] = {}
    for c in cases:
        name = c.kernel.split("[")[0] + (" (fp8 cache)" if "[fp8]" in c.kernel else "")
        groups.setdefault((name, c.dtype), []).append(c)
    for (kernel, dtype), cs in groups.items():
        worst = max(c.max_rel_err for c in cs)
        lines.append(f"| {kernel} | {dtype} | {len(cs)} | {sum(not c.ok for c in cs)} | "
                     f"{worst:.2e} |")
    bad = [f"- FAILED {c.kernel} {c.dtype} {c.shape}: {c.max_rel_err:.3e}"
           for c in cases if not c.ok]
    return "\n".join(lines + ([""] + bad if bad else []))


def main() -> int:
    """python tests/kernels/fused_conformance.py --device cuda --dtypes ... --out f.md"""
    import argparse

    ap = argparse.ArgumentParser(description="fused layer kernel conformance")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--out")
    args = ap.parse_args()
    cases = run_fused_conformance(args.device, [getattr(torch, d) for d in
                                                args.dtypes.split(",")],
                                  tuple(int(x) for x in args.head_dims.split(",")))
    text = as_markdown(cases) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 1 if any(not c.ok for c in cases) else 0


if __name__ == "__main__":
    raise SystemExit(main())
