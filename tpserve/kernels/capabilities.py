"""Shared checks for backends that implement a fixed set of AttentionSpec features.

AttentionSpec grows as model families arrive (encoder-decoder, relative position bias, ...).
A backend written before a field existed must decline a spec that uses it rather than
compute something else silently, so the check is generic: any field the backend does not
know that is set to a non-default value is a reason.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tpserve.kernels.base import AttentionSpec
from tpserve.kernels.kv_quant import FP8_FEATURE, fp8_refusal

# The fields every backend in this package understands.
CORE_FIELDS = frozenset({"num_heads", "num_kv_heads", "head_dim", "scale", "sliding_window",
                         "alibi", "softcap", "block_size"})
CORE_FEATURES = frozenset({"prefill", "decode", "sliding_window", "alibi", "softcap"})


# Why the IPEX backend declines a spec with attention sinks (gpt-oss).
SINKS_REASON = ("attention sinks (gpt-oss) are implemented in the torch and triton backends "
                "only; use --kernel torch, triton or auto")
# Why it declines chunked attention (Llama 4's RoPE layers).
CHUNKED_REASON = ("chunked attention (Llama 4's attention_chunk_size) is implemented in the "
                  "torch and triton backends only; use --kernel torch, triton or auto")


def unknown_feature_reason(spec: AttentionSpec, known_fields: frozenset[str] = CORE_FIELDS,
                           known_features: frozenset[str] = CORE_FEATURES) -> str | None:
    """Why `spec` asks for something outside `known_*`, or None."""
    extra = sorted(set(getattr(spec, "features", frozenset())) - known_features)
    if FP8_FEATURE in extra:
        return fp8_refusal()
    if extra:
        return f"features not implemented: {', '.join(extra)}"
    if getattr(spec, "causal", True) is False:
        return "non-causal (encoder or cross) attention is not implemented"
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            if f.name in known_fields:
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            value = getattr(spec, f.name)
            if value != default and f.name != "causal":
                return f"attention spec field {f.name}={value!r} is not implemented"
    return None


@functools.cache
def device_has_float64(device: torch.device) -> bool:
    """Some Intel GPUs (Arc) have no float64: kernels that want it take another formula."""
    if device.type != "xpu":
        return True
    return bool(getattr(torch.xpu.get_device_properties(device), "has_fp64", True))


def stream_capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a graph: code whose shapes follow the
    data (a mixture of experts' routing) takes a fixed-shape path then. Only CUDA graphs
    are captured (cluster/device.py, graph_api)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
