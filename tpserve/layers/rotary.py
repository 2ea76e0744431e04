"""Rotary position embedding (the rotate-half layout transformers uses) with the rope
scaling types of Llama 3 and friends. Tables are built once in float32."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.hf_config import longrope_original, rope_parameters  # noqa: F401 - re-exported
from tpserve.kernels.fused_ops import plan_rotary


def layer_rope_parameters(config) -> dict[str, dict] | None:
    """Rope settings per layer type ({"sliding_attention": {...}, "full_attention": {...}}),
    where the config gives each type its own (Gemma 3: a local base frequency for the
    windowed layers); None where one setting serves every layer."""
    types = getattr(config, "layer_types", None)
    params = getattr(config, "rope_parameters", None) or {}
    if not types or not all(isinstance(params.get(t), dict) for t in set(types)):
        return None
    default = getattr(config, "max_position_embeddings", None)
    out = {}
    for t in sorted(set(types)):
        p = dict(params[t])
        if "type" in p and "rope_type" not in p:
            p["rope_type"] = p.pop("type")
        p.setdefault("rope_type", "default")
        p.setdefault("rope_theta", 10000.0)
        p.setdefault("max_position_embeddings", default)
        out[t] = p
    return out


def partial_rotary_factor(config) -> float:
    """The share of each head's dimensions that rotate (the first ones; the rest pass
    through): partial_rotary_factor (Phi, Phi-3, and where transformers 5 keeps it, in
    rope_parameters) or GPT-NeoX's rotary_pct in a config read without transformers; 1.0
    when none is given."""
    rope = rope_parameters(config)
    return float(getattr(config, "partial_rotary_factor", None)
                 or rope.get("partial_rotary_factor")
                 or getattr(config, "rotary_pct", None) or 1.0)


def inv_frequencies(rot_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rot_dim / 2], attention scaling applied to cos/sin)."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = params["rope_type"]
    if kind in ("default", "dynamic"):
        # Dynamic NTK: transformers' own frequencies until a sequence passes
        # max_position_embeddings (RotaryEmbedding refuses a table longer than that).
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rot_dim, base, params)
    if kind == "longrope":
        return _longrope(rot_dim, base, params)
    raise ValueError(
        f"rope_type {kind!r} is not supported yet (supported: default, linear, dynamic, llama3, "
        "yarn, longrope); the model's config.json asks for it"
    )


def _longrope(rot_dim: int, base: float, params: dict, key: str = "short_factor"
              ) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3-*-128k, Phi-3.5, Phi-4-mini): each frequency divided by its own
    factor (key: short_factor within the original context, long_factor past it); cos/sin
    scaled by sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings /
    original unless given, the same for both sets. As transformers'
    _compute_longrope_parameters."""
    original = longrope_original(params)
    ext = torch.tensor(params[key], dtype=torch.float32)
    if ext.numel() != rot_dim // 2:
        raise ValueError(
            f"rope_scaling {key} has {ext.numel()} entries but the rotary dimension "
            f"{rot_dim} needs rot_dim / 2 = {rot_dim // 2} (one per frequency): the "
            "checkpoint's config.json is inconsistent")
    factor = params.get("factor") or float(params["max_position_embeddings"]) / original
    attn = params.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    return 1.0 / (ext * base**shape), float(attn)


def _yarn(rot_dim: int, base: float, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, blend linearly
    between the dimensions that rotate beta_slow and beta_fast times over the original
    context; cos/sin are scaled by the attention factor (0.1 ln(factor) + 1 by default)."""
    old_len = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or float(params["max_position_embeddings"]) / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_for(rotations: float) -> float:
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_for(params.get("beta_fast") or 32), dim_for(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return (1.0 / (factor * freqs)) * ramp + (1.0 / freqs) * keep, float(attn)


def _check_dynamic_length(params: dict, max_positions: int) -> None:
    """Dynamic NTK rescales the frequencies by the longest position of each forward pass once
    it passes max_position_embeddings, so keys already cached were rotated by other ones:
    one table cannot follow that, and tpserve serves such a model within its positions."""
    limit = params.get("max_position_embeddings")
    if params["rope_type"] == "dynamic" and limit and max_positions > int(limit):
        raise ValueError(
            f"rope_type 'dynamic' (dynamic NTK scaling) changes the rotary frequencies once a "
            f"sequence passes the model's {limit} positions (max_position_embeddings), which a "
            f"paged KV cache cannot follow; tpserve serves this model up to {limit} tokens, "
            f"where its rotary is the unscaled one: pass --max-total-tokens {limit} or less "
            f"(asked for {max_positions})")


def _table(rot_dim: int, positions: int, inv: torch.Tensor, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [positions, rot_dim] of inverse frequencies inv, times scale."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables gathered by position. A longrope model's table holds two factor sets:
    rows [0, original) are the short factors' positions 0..original-1, the rows after them
    the long factors' positions 0..max_positions-1. A sequence longer than original is
    rotated entirely with the long ones (as transformers does), so its positions arrive
    offset by long_offset (the worker adds it); cos_sin never needs to know which set."""

    def __init__(self, head_dim: int, max_positions: int, params: dict,
                 partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * partial_rotary_factor)
        _check_dynamic_length(params, max_positions)
        plan_rotary(self.rot_dim)  # the attention backend's warmup compiles this width
        # Where the long factors' rows start (longrope only), else None.
        self.long_offset = longrope_original(params)
        if self.long_offset is None:
            cos, sin = _table(self.rot_dim, max_positions, *inv_frequencies(self.rot_dim, params))
        else:
            base = float(params["rope_theta"])
            short = _table(self.rot_dim, self.long_offset, *_longrope(self.rot_dim, base, params))
            long = _table(self.rot_dim, max_positions,
                          *_longrope(self.rot_dim, base, params, "long_factor"))
            cos, sin = torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's [T, rot_dim] cos and sin in `dtype`: gathered once per step and shared
        by every layer (the attention backend applies them with the cache write)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rot_dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
