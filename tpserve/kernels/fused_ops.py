"""Fused per-layer operations with one torch reference each, dispatched by device.

The models call `add_rms_norm`, `gated_act` and (through the attention backend)
`rotary_write_kv`. On CUDA and XPU with Triton installed they run the one-launch kernels of
triton_fused.py; everywhere else (the CPU, a missing or broken Triton) the torch code here,
which is also the oracle the conformance tests hold the kernels to. Set TPSERVE_FUSED=0 to
force the torch path on a GPU (for A/B measurements).
"""

from __future__ import annotations

import functools
import os

import torch

from tpserve.kernels import pdl

# Devices whose Triton backend runs these kernels (Triton's names: nvidia, intel).
_TRITON_DEVICES = ("cuda", "xpu")
GATED_ACTS = {"silu": False, "swish": False, "gelu_pytorch_tanh": True, "gelu_new": True,
              "gelu_fast": True}  # name -> uses the tanh GELU


@functools.cache
def _triton_reason(device_type: str) -> str | None:
    from tpserve.kernels.compile_cache import triton_missing

    return triton_missing(device_type)


_DISABLED = os.environ.get("TPSERVE_FUSED") == "0"  # read once: checked per layer call


def use_triton(t: torch.Tensor) -> bool:
    """True when `t`'s device runs the Triton kernels here (never on the CPU)."""
    if _DISABLED or t.device.type not in _TRITON_DEVICES:
        return False
    return _triton_reason(t.device.type) is None


def _kernels():
    from tpserve.kernels import triton_fused

    return triton_fused


# Variants the layers built in this process will launch (norm: hidden, offset, cast_first;
# act: tanh GELU or not), so warmup can compile them before the first request.
_PLANNED_NORMS: set[tuple[int, float, bool]] = set()
_PLANNED_ACTS: set[bool] = set()
_PLANNED_VOCABS: set[int] = set()  # the greedy reduction's tile count follows the vocabulary
# Rotary widths (rotated dims per head) of the models built here: the attention backend's
# warmup compiles its rotary launches at these widths (kernels specialise on them).
_PLANNED_ROTARY: set[int] = set()


def plan_norm(hidden: int, offset: float, cast_first: bool) -> None:
    _PLANNED_NORMS.add((hidden, float(offset), bool(cast_first)))


def plan_rotary(rot_dim: int) -> None:
    _PLANNED_ROTARY.add(int(rot_dim))


def plan_unrotated() -> None:
    """A layer of a model built here attends without rotary while others rotate (Cohere 2's
    full-attention layers): warmup compiles the decode launch without rotary too."""
    _PLANNED_ROTARY.add(0)


def planned_unrotated() -> bool:
    return 0 in _PLANNED_ROTARY


def planned_rotary_dims(head_dim: int) -> list[int]:
    """The planned rotary widths a layer of `head_dim` can use; [] when no model built in
    this process rotates (ALiBi or other positions)."""
    return sorted(d for d in _PLANNED_ROTARY if 0 < d <= head_dim and d % 2 == 0)


def plan_greedy(vocab: int) -> None:
    _PLANNED_VOCABS.add(int(vocab))


def plan_act(name: str) -> None:
    if name in GATED_ACTS:
        _PLANNED_ACTS.add(GATED_ACTS[name])


def warmup(device: torch.device, dtype: torch.dtype) -> int:
    """Launch every planned fused variant once on `device` (compiling it, or loading it from
    Triton's disk cache); the launches a forward makes then compile nothing. Returns how
    many were launched (0 where the torch path serves)."""
    if not use_triton(torch.empty(0, device=device)):
        return 0
    n = 0
    for rows in (1, pdl.MAX_ROWS + 1):  # launches of a few rows and of many (kernels/pdl.py)
        for hidden, offset, cast_first in sorted(_PLANNED_NORMS):
            x = torch.zeros(rows, hidden, dtype=dtype, device=device)
            w = torch.ones(hidden, dtype=dtype, device=device)
            for res in (None, x):
                add_rms_norm_triton(x, res, w, 1e-6, offset, cast_first)
                n += 1
        for gelu in sorted(_PLANNED_ACTS):
            gated_act_triton(torch.zeros(rows, 32, dtype=dtype, device=device), gelu)
            n += 1
    gumbel_argmax_triton(torch.zeros(2, 8, device=device),
                         torch.zeros(2, dtype=torch.int64, device=device))
    for vocab in sorted(_PLANNED_VOCABS):
        # The sampler hands the LM head's logits over as they are: the model's dtype.
        greedy_triton(torch.zeros(1, vocab, dtype=dtype, device=device))
        n += 1
    return n + 1


GREEDY_CHUNK = 4096  # logits per program of the greedy reduction (32 programs per 128k row)


def greedy_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, log_softmax at the argmax) per row of logits x [n, vocab] (float32 or the
    model's dtype, widened in registers), as x.float().argmax(-1) and
    x.float().log_softmax(-1).gather(...) give them (first index on ties, NaN
    counted as the largest; a row without a finite maximum gets NaN), in two launches."""
    from tpserve.kernels.triton_sampling import greedy_chunk_kernel, greedy_combine_kernel

    x = x.contiguous()
    n, vocab = x.shape
    chunks = -(-vocab // GREEDY_CHUNK)
    m = torch.empty(n, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, chunks, dtype=torch.int32, device=x.device)
    s = torch.empty(n, chunks, dtype=torch.float32, device=x.device)
    tok = torch.empty(n, dtype=torch.int64, device=x.device)
    lp = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        greedy_chunk_kernel[(n, chunks)](x, m, idx, s, vocab, x.stride(0), CHUNK=GREEDY_CHUNK,
                                         BLOCK=1024, num_warps=4)
        greedy_combine_kernel[(n,)](m, idx, s, tok, lp, chunks,
                                    CHUNKS=max(2, 1 << (chunks - 1).bit_length()), num_warps=1)
    return tok, lp


def gumbel_argmax_triton(f: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The sampler's Gumbel-max draw (layers/sampler.py) in one pass: f [n, vocab] float32
    filtered logits, keys [n] int64 row keys."""
    from tpserve.kernels.triton_sampling import gumbel_argmax_kernel

    f, keys = f.contiguous(), keys.contiguous()
    out = torch.empty(f.shape[0], dtype=torch.int64, device=f.device)
    if f.shape[0]:
        gumbel_argmax_kernel[(f.shape[0],)](f, keys, out, f.shape[1], f.stride(0), BLOCK=1024,
                                            num_warps=4)
    return out


# --- residual add + RMSNorm ---------------------------------------------------------------
def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, offset: float = 0.0, cast_first: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); without a residual, (rmsnorm(x), x).
    cast_first: Llama multiplies after casting back to the input dtype; Gemma in float32."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if cast_first:
        w = weight + offset if offset else weight
        return w * h.to(dtype), x
    return (h * (weight.float() + offset)).to(dtype), x


def add_rms_norm_triton(x, residual, weight, eps, offset=0.0, cast_first=True):
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, cols = x2.shape
    out = torch.empty_like(x2)
    res_in = x2 if residual is None else residual.reshape(-1, cols)
    if res_in.stride(-1) != 1:
        res_in = res_in.contiguous()
    res_out = torch.empty_like(x2) if residual is not None else x2
    block = triton_block(cols)
    if n:
        _kernels().add_rms_norm_kernel[(n,)](
            x2, res_in, weight, out, res_out, cols, float(eps), float(offset),
            x2.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=residual is not None, CAST_FIRST=cast_first, BLOCK=block,
            num_warps=min(16, max(4, block // 1024)), **pdl.launch(x.device, n))
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else x)


def triton_block(cols: int) -> int:
    return 1 << max(4, (cols - 1).bit_length())


def add_rms_norm(x, residual, weight, eps, offset=0.0, cast_first=True):
    impl = add_rms_norm_triton if use_triton(x) else add_rms_norm_torch
    return impl(x, residual, weight, eps, offset, cast_first)


# --- gated activations --------------------------------------------------------------------
def gated_act_torch(x: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up over x = [gate; up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def gated_act_triton(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    cols = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], cols, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _kernels().gated_act_kernel[(x2.shape[0], -(-cols // block))](
            x2, out, cols, x2.stride(0), out.stride(0), GELU_TANH=gelu_tanh, BLOCK=block,
            num_warps=4, **pdl.launch(x.device, x2.shape[0]))
    return out.view(*x.shape[:-1], cols)


def gated_act(x: torch.Tensor, name: str, act) -> torch.Tensor:
    if name in GATED_ACTS and use_triton(x):
        return gated_act_triton(x, GATED_ACTS[name])
    return gated_act_torch(x, act)


# --- rotary embedding + KV-cache write ----------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rot_dim] in x's dtype (rot_dim <= head_dim)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def head_pad(head_dim: int) -> int:
    """The power of two that Triton tiles pad a head's dims to (tl.arange needs one)."""
    return 1 << (head_dim - 1).bit_length()


def rotary_warps(heads_per_program: int, head_dim: int) -> int:
    """Warps for rotary_write_kv_kernel: about one per 256 values a program holds, at most 4.
    A power of two, as Triton requires (8 heads of 96 hold 768 values: 2 warps, not 3)."""
    if heads_per_program == 1:
        return 1 if head_dim <= 64 else 2
    values = heads_per_program * head_dim // 256
    return min(4, 1 << max(0, values.bit_length() - 1))


def rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           heads_per_program: int | None = None) -> torch.Tensor:
    """Rotate q and k ([T, heads, head_dim]), store k and v at their cache slots (the default
    layout [blocks, block_size, kv_heads, head_dim]) and return the rotated q, in one launch.
    An fp8 (e4m3fn) cache stores clamp(x / scale, +-448) as kv_quant.quantize does.
    heads_per_program (a power of two): fixed by tests; by default chosen by token count."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kc = k_cache.view(-1, hkv, d)
    vc = v_cache.view(-1, hkv, d)
    if kc.stride() != vc.stride() or kc.stride(-1) != 1:
        raise ValueError("rotary_write_kv_triton needs K and V caches of one contiguous layout")
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise ValueError("rotary_write_kv_triton needs unit stride on head_dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    if t:
        # A head per program keeps a few tokens' launch short (decode of one stream);
        # more tokens take up to 8 heads per program (prefill: 8x fewer programs). The
        # split follows PDL's, so warmup's one-row and many-row forwards compile both.
        hb = heads_per_program or (1 if t <= pdl.MAX_ROWS else
                                   min(8, 1 << (max(hq, hkv) - 1).bit_length()))
        grid = (t, -(-hq // hb) + -(-hkv // hb))
        _kernels().rotary_write_kv_kernel[grid](
            q, k, v, cos, sin, slot_mapping, q_out, kc, vc,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1),
            1.0 / k_scale, 1.0 / v_scale, NUM_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=d,
            ROT=cos.shape[-1], HB=hb, KV_FP8=kc.dtype == getattr(torch, "float8_e4m3fn", None),
            HEAD_PAD=head_pad(d),
            num_warps=rotary_warps(hb, d),
            **pdl.launch(q.device, t))
    return q_out
