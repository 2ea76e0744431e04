"""The FP8 (e4m3) KV cache: one storage dtype, one quantize and one dequantize rule.

`--kv-cache-dtype fp8` stores keys and values as torch.float8_e4m3fn with a per-tensor
scale for K and for V (AttentionSpec.k_scale / v_scale, 1.0 unless a checkpoint gives one):
stored = clamp(x / scale, -448, 448), read = stored * scale in the compute dtype. The clamp
matters: PyTorch's cast to e4m3fn does not saturate on every device (out of range becomes
NaN, which one token would spread through every later attention). The division is a
multiplication by 1 / scale in float32, which the Triton kernels do the same way, so both
store the same bits.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite e4m3fn value
# Built-in backends that read and write an fp8 cache (the rest refuse it in supports()).
FP8_BACKENDS = ("torch", "triton")
FP8_FEATURE = "fp8_kv_cache"  # AttentionSpec.features entry of a spec with an fp8 cache


def fp8_refusal(backend: str | None = None) -> str:
    """supports()'s reason for a backend without an fp8 cache."""
    who = f"the {backend} backend has" if backend else "this backend has"
    return (f"{who} no fp8 KV cache (--kv-cache-dtype fp8 runs on the "
            f"{' and '.join(FP8_BACKENDS)} backends; --kv-cache-dtype auto keeps the model "
            "dtype)")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a KV cache: "auto" is the model dtype, "fp8" is e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        if FP8_DTYPE is None:
            raise RuntimeError(fp8_missing())
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', not {kv_cache_dtype!r}")


def fp8_missing() -> str:
    return (f"--kv-cache-dtype fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
            "lacks: install PyTorch >= 2.1 or use --kv-cache-dtype auto")


@functools.cache
def fp8_unavailable(device: torch.device) -> str | None:
    """None when an fp8 cache can be written and read on `device` with torch ops, else why
    not (a torch build without float8, a device whose torch cannot cast to it)."""
    if FP8_DTYPE is None:
        return fp8_missing()
    try:
        x = torch.tensor([1.5, -500.0], device=device)
        stored = torch.zeros(4, dtype=FP8_DTYPE, device=device)
        stored[torch.tensor([0, 2], device=device)] = quantize(x, 1.0)
        back = stored.to(torch.float32).cpu().tolist()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return (f"torch {torch.__version__} cannot store float8_e4m3fn on {device.type} "
                f"({type(exc).__name__}: {exc}); use --kv-cache-dtype auto")
    if back != [1.5, 0.0, -FP8_MAX, 0.0]:
        return (f"torch {torch.__version__} stores float8_e4m3fn wrongly on {device.type} "
                f"(1.5, -500 read back as {back[0]}, {back[2]}); use --kv-cache-dtype auto")
    return None


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3fn values clamp(x / scale, +-448), rounded to nearest."""
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y * (1.0 / scale)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3fn values -> dtype (exact for float16/bfloat16/float32), times scale."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale


def is_fp8(t: torch.Tensor) -> bool:
    return FP8_DTYPE is not None and t.dtype == FP8_DTYPE
