"""Paged attention through intel_extension_for_pytorch (IPEX) on Intel CPUs and XPUs.

Uses ipex.llm.modules.PagedAttention: reshape_and_cache writes K/V, flash_attn_varlen_func
runs prefill (and mixed) steps over the paged cache, single_query_cached_kv_attention runs
decode-only steps. IPEX's cache layout is [num_blocks, kv_heads, block_size, head_dim].

IPEX pins one torch minor version and its keyword arguments have grown over releases
(window sizes and softcap arrived late), so supports() imports it lazily, reports import
failures as the reason, and declines features the installed version's signatures lack.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import cache

import torch

from tpserve.kernels.base import AttentionBackend, AttentionSpec
from tpserve.kernels.capabilities import CHUNKED_REASON, SINKS_REASON, unknown_feature_reason
from tpserve.kernels.kv_quant import fp8_refusal

DTYPES = {"cpu": (torch.float32, torch.bfloat16), "xpu": (torch.float16, torch.bfloat16,
                                                           torch.float32)}


@cache
def _ipex():
    """(module, None) or (None, reason)."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return None, "intel_extension_for_pytorch is not installed"
    try:
        import intel_extension_for_pytorch as ipex
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - IPEX exits on a torch mismatch
        return None, (f"intel_extension_for_pytorch cannot be imported with torch "
                      f"{torch.__version__} ({type(exc).__name__}: {exc})")
    if not hasattr(getattr(getattr(ipex, "llm", None), "modules", None), "PagedAttention"):
        return None, f"intel_extension_for_pytorch {ipex.__version__} has no llm PagedAttention"
    return ipex, None


def _params(fn) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


class IpexAttentionBackend(AttentionBackend):
    name = "ipex"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
        if spec.sinks:
            return SINKS_REASON
        if spec.attention_chunk:
            return CHUNKED_REASON
        if spec.kv_cache_dtype != "auto":  # reshape_and_cache / its kernels take float caches
            return fp8_refusal(cls.name)
        ipex, reason = _ipex()
        if reason:
            return reason
        if device.type not in DTYPES:
            return f"IPEX paged attention runs on CPU and XPU, not {device.type}"
        if dtype not in DTYPES[device.type]:
            names = ", ".join(str(d).replace("torch.", "") for d in DTYPES[device.type])
            return f"dtype {dtype} is not supported on {device.type} ({names})"
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        ops = ipex.llm.modules.PagedAttention
        varlen = _params(ops.flash_attn_varlen_func)
        single = _params(ops.single_query_cached_kv_attention)
        if spec.sliding_window and not ("window_size_left" in varlen and "window_size" in single):
            return f"intel_extension_for_pytorch {ipex.__version__} has no sliding window"
        if spec.softcap and not ("softcap" in varlen and "softcap" in single):
            return f"intel_extension_for_pytorch {ipex.__version__} has no softcap"
        if device.type == "cpu":
            # Limits its CPU kernels raise at run time (seen with IPEX 2.8.0, docs/kernels.md).
            if spec.alibi:
                return "IPEX's CPU flash_attn_varlen_func has no ALiBi (prefill would fail)"
            if spec.sliding_window and spec.softcap:
                return "IPEX's CPU decode kernel cannot combine a sliding window with softcap"
        return unknown_feature_reason(spec)

    @property
    def _ops(self):
        return _ipex()[0].llm.modules.PagedAttention

    def kv_cache_shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._ops.reshape_and_cache(k.to(k_cache.dtype).contiguous(),
                                    v.to(v_cache.dtype).contiguous(), k_cache, v_cache,
                                    slot_mapping)

    def _extras(self, spec: AttentionSpec, left_name: str) -> dict:
        # Pass new keywords only when used, so older IPEX releases still take the call.
        extra = {}
        if spec.sliding_window:
            extra[left_name] = spec.sliding_window - (left_name == "window_size_left")
        if spec.softcap:
            extra["softcap"] = float(spec.softcap)
        return extra

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None):
        out = torch.empty_like(q)
        group = spec.num_heads // spec.num_kv_heads
        head_mapping = torch.arange(spec.num_kv_heads, dtype=torch.int32,
                                    device=q.device).repeat_interleave(group)
        self._ops.single_query_cached_kv_attention(
            out, q.contiguous(), k_cache, v_cache, head_mapping, float(spec.scale),
            meta.block_tables.int(), meta.seq_lens.int(), spec.block_size, meta.max_seq_len,
            _slopes(alibi_slopes, spec), **self._extras(spec, "window_size"))
        return out

    def prefill(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None):
        out = torch.empty_like(q)
        cu_kv = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        cu_kv[1:] = meta.seq_lens.cumsum(0)
        self._ops.flash_attn_varlen_func(
            out, q.contiguous(), k_cache, v_cache, meta.query_start_loc.int(), cu_kv,
            meta.max_query_len, meta.max_seq_len, float(spec.scale), True,
            meta.block_tables.int(), _slopes(alibi_slopes, spec),
            **self._extras(spec, "window_size_left"))
        return out


def _slopes(alibi_slopes: torch.Tensor | None, spec: AttentionSpec) -> torch.Tensor | None:
    return alibi_slopes.float().contiguous() if spec.alibi and alibi_slopes is not None else None
