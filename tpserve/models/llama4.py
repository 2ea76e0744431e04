"""Llama 4 (Scout 17B-16E, Maverick 17B-128E) as text: Llama4ForCausalLM, and
Llama4ForConditionalGeneration served through its language model (hf_config.TEXT_ONLY; the
vision tower and projector are never read).

Each layer is Llama's pre-norm layer with:
- attention on RoPE or NoPE layers (no_rope_layers: 1 rotates, 0 does not; by default every
  fourth layer is NoPE). RoPE layers rotate interleaved pairs (transformers multiplies
  complex numbers), served as rotate-half by reordering q_proj / k_proj rows at load
  (layers/interleaved_rotary.py; an fp8 checkpoint's per-channel scales with them, an
  int4 checkpoint's output columns, packed or not, by half_order_rows); with use_qk_norm
  an L2 norm without weight over each head's query and key follows the rotary, applied
  here before it: a rotation keeps each pair's length, so the norm is the same either side
  of it (the rope types that do not rescale cos and sin only, checked at start); and they
  attend in chunks of attention_chunk_size (layer_types "chunked_attention",
  kernels/base.py). NoPE layers attend to everything, and
  with attn_temperature_tuning scale each query by log1p(floor((p + 1) / floor_scale)) *
  attn_scale + 1 at its position p.
- a feed-forward block that is Llama4MoE (models/llama4_moe.py) on the layers moe_layers
  names (Scout: all; Maverick: every other, interleave_moe_layer_step 2), else a gated MLP
  of intermediate_size_mlp.

No norm fold (the worker logs why): fold_norms assumes Llama's layer and a one-row GEMV
down_proj, and half of these layers' blocks are experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tpserve.errors import CheckpointError
from tpserve.hf_config import rope_parameters
from tpserve.kernels.fused_ops import plan_unrotated
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import ParallelLMHead
from tpserve.layers.interleaved_rotary import HalfOrderRows, half_order_rows
from tpserve.layers.quant.config import QuantizationError, current_quant
from tpserve.models.experts import FLOAT_TENSORS
from tpserve.models.llama import (
    GatedMLP,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
    rms_norm_maker,
)
from tpserve.models.llama4_moe import Llama4MoE
from tpserve.models.loader import VISION_TENSORS, decoder_names, load_into
from tpserve.weights import TensorSlice

# Rope types whose cos / sin have unit length (attention factor 1), so the qk norm commutes
# with the rotary (module docstring).
_ROPE_TYPES = ("default", "llama3", "linear")
# Llama 4's vision tower and projector, beside loader.VISION_TENSORS' names.
_VISION = VISION_TENSORS + ("vision_model.",)


def l2_heads(x: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """Each head's x / rms(x) in float32, back in x's dtype (transformers'
    Llama4TextL2Norm)."""
    h = x.reshape(-1, head_dim).float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).view(x.shape)


class Llama4Attention(LlamaAttention):
    def __init__(self, config, layer: int, prefix: str, max_positions: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer, prefix, max_positions, bias=bias, o_bias=bias)
        self.rotary = bool(config.no_rope_layers[layer])
        self.qk_norm_eps = config.rms_norm_eps if self.rotary and config.use_qk_norm else None
        self.temperature = not self.rotary and bool(config.attn_temperature_tuning)
        chunked = config.layer_types[layer] == "chunked_attention"
        self.attn = PagedAttention(layer, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                   self.head_dim, self.head_dim**-0.5,
                                   attention_chunk=config.attention_chunk_size if chunked
                                   else None)
        if not self.rotary:
            plan_unrotated()  # the attention backend's warmup compiles that launch too

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                temperature: torch.Tensor | None) -> torch.Tensor:
        """temperature: [tokens] query scales of the NoPE layers (None: no tuning)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        d = self.head_dim
        if self.qk_norm_eps is not None:
            q, k = l2_heads(q, d, self.qk_norm_eps), l2_heads(k, d, self.qk_norm_eps)
        if self.temperature and temperature is not None:
            scaled = q.reshape(q.shape[0], -1, d) * temperature.view(-1, 1, 1)
            q = scaled.to(q.dtype).view(q.shape)
        return self.o_proj(self.attn(q, k, v, rope=rope if self.rotary else None))


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str, max_positions: int) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(config, layer, f"{prefix}.self_attn", max_positions)
        ff = f"{prefix}.feed_forward"  # the checkpoint's name, for errors
        self.mlp = Llama4MoE(config, ff) if layer in config.moe_layers else GatedMLP(
            config.hidden_size, config.intermediate_size_mlp, config.hidden_act, ff)
        make_norm = rms_norm_maker(config)
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, temperature: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (this layer's MLP output, residual stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, temperature),
                                                    residual)
        return self.mlp(h), residual


class Llama4Model(LlamaModel):
    def __init__(self, config, max_positions: int) -> None:
        # Whole heads rotate (transformers' Llama 4 reads no partial_rotary_factor).
        super().__init__(config, max_positions, make_layer=self._make_layer,
                         rotary_fraction=1.0)
        tuned = bool(config.attn_temperature_tuning)
        self.floor_scale = float(config.floor_scale) if tuned else None
        self.attn_scale = float(config.attn_scale)

    @staticmethod
    def _make_layer(config, i: int, prefix: str, max_positions: int, window) -> nn.Module:
        return Llama4DecoderLayer(config, i, prefix, max_positions)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[tokens] float32 query scales of the NoPE layers, as transformers computes them."""
        if self.floor_scale is None:
            return None
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return torch.log1p(steps) * self.attn_scale + 1.0

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        rope = self.rotaries["all"].cos_sin(positions, x.dtype)
        temperature = self.temperature(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, temperature)
        return self.norm(x, residual)[0]


def _rename(name: str) -> str:
    """A checkpoint name -> the parameter's: the feed-forward block is `mlp` (Llama's
    layer name the loader's stacked names expect), its router SparseMoE's `gate`, the fused
    experts its w13 / w2."""
    name = decoder_names("model.")(name).replace(".feed_forward.", ".mlp.")
    name = name.replace(".mlp.router.", ".mlp.gate.")
    return name.replace(".mlp.experts.gate_up_proj", ".mlp.w13").replace(
        ".mlp.experts.down_proj", ".mlp.w2")


# q_proj / k_proj tensors whose rows are the projection's output features: reordered per
# head. A per-tensor scale (one number) and fp8 block scales whose block rows hold whole
# heads (checked at start) are the same in either order.
_ROW_TENSORS = ("weight", "bias", "weight_scale")
_SAME_TENSORS = ("input_scale", "weight_scale_inv")
# int4 methods whose q/k tensors interleaved_rotary.half_order_rows reorders (packed or not).
_INT4 = ("gptq", "awq", "compressed-tensors")


def _with_half_order(tensors: Iterable[TensorSlice], head_dim: int,
                     method: str | None = None) -> Iterator:
    """q_proj's and k_proj's rows (weights, biases and fp8 per-channel weight_scale alike)
    in each head's rotate-half order; method: the checkpoint's int4 quantization (gptq, awq,
    compressed-tensors), whose q/k tensors half_order_rows reorders along their output
    features (unpacking and repacking the packed ones), or None (float or fp8). The vision
    tower's q_proj / k_proj (never read) pass as they are, whatever their tensors."""
    for w in tensors:
        if (".self_attn.q_proj." not in w.name and ".self_attn.k_proj." not in w.name) or \
                any(s in w.name for s in _VISION):
            yield w
            continue
        if method in _INT4:
            yield half_order_rows(w, head_dim, method)
            continue
        tensor = w.name.rpartition(".")[2]
        if tensor in _SAME_TENSORS or (tensor in _ROW_TENSORS and math.prod(w.shape) == 1):
            yield w
        elif tensor in _ROW_TENSORS:
            yield HalfOrderRows(w, head_dim)
        else:
            raise CheckpointError(
                f"checkpoint tensor {w.name!r}: Llama 4 reorders q_proj / k_proj rows within "
                f"each head at load (interleaved rotary), which tpserve does for float and fp8 "
                f"tensors ({', '.join(_ROW_TENSORS + _SAME_TENSORS)}), not {tensor!r}")


def _fused_experts_refused(tensors: Iterable[TensorSlice]) -> Iterator:
    """A quantized checkpoint's experts stored fused (experts.gate_up_proj with a per-expert
    channel scale, as transformers' fbgemm_fp8 holds them) and a router stored quantized
    (GPTQ's router.qweight ...) are refused naming the tensor."""
    for w in tensors:
        if ".feed_forward.experts.gate_up_proj" in w.name or \
                ".feed_forward.experts.down_proj" in w.name:
            raise CheckpointError(
                f"checkpoint tensor {w.name!r}: experts stored fused in a quantized Llama 4 "
                f"checkpoint; tpserve reads quantized experts stored one by one "
                f"(feed_forward.experts.{{e}}.gate_proj / up_proj / down_proj), as Meta's and "
                f"llm-compressor's fp8 releases store them")
        if ".feed_forward.router." in w.name and \
                w.name.rpartition(".")[2] not in FLOAT_TENSORS:
            raise CheckpointError(
                f"checkpoint tensor {w.name!r}: the router is stored quantized; tpserve keeps "
                f"routers float (feed_forward.router.weight), as the released quantized "
                f"mixture-of-experts checkpoints store them")
        yield w


def check_quant(config) -> str | None:
    """The int4 method (gptq, awq, compressed-tensors pack-quantized) whose q/k tensors the
    load reorders, or None (float, fp8, or --quantize fp8: a cast after the reorder). Refuses
    (QuantizationError) fp8 blocks that cut a head."""
    q = current_quant()
    if q is None or q.cast_at_load:
        return None
    if q.method in _INT4:
        return q.method
    if q.method != "fp8":
        raise QuantizationError(
            f"Llama 4 checkpoints quantized with {q.method} are not supported: Llama 4 "
            f"reorders q_proj / k_proj output rows within each head at load (its interleaved "
            f"rotary), which tpserve does for float, fp8 and GPTQ, AWQ and compressed-tensors "
            f"int4 tensors. Serve the float checkpoint with --quantize fp8 instead")
    d = head_dim_of(config)
    if q.block is not None and q.block[0] % d:
        raise QuantizationError(
            f"Llama 4 fp8 checkpoint with weight_block_size {list(q.block)}: the q_proj / k_proj "
            f"weight_scale_inv blocks of {q.block[0]} rows cut heads of {d}, whose rows tpserve "
            f"reorders within each head at load; it serves blocks whose rows are a multiple of "
            f"head_dim ({d})")
    return None


def check_config(config) -> None:
    """Refuse (ValueError) what this family does not serve, naming the option."""
    rope = rope_parameters(config)["rope_type"]
    if rope not in _ROPE_TYPES:
        raise ValueError(f"Llama 4 with rope_type {rope!r} is not supported: its qk norm is "
                         f"applied before the rotary, which holds for rope types that do not "
                         f"rescale cos and sin ({', '.join(_ROPE_TYPES)})")
    rotates = list(config.no_rope_layers)
    if len(rotates) != config.num_hidden_layers or len(config.layer_types) != len(rotates):
        raise ValueError(f"Llama 4 config.json no_rope_layers ({len(rotates)} entries) and "
                         f"layer_types ({len(config.layer_types)}) must have one entry per "
                         f"layer ({config.num_hidden_layers}): fix the checkpoint's config")
    unknown = sorted(set(config.layer_types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise ValueError(f"Llama 4 layer_types {unknown} are not supported (chunked_attention, "
                         f"full_attention)")
    if "chunked_attention" in config.layer_types and not config.attention_chunk_size:
        raise ValueError("Llama 4 config.json marks chunked_attention layers but sets no "
                         "attention_chunk_size: fix the checkpoint's config")


class Llama4ForCausalLM(LlamaForCausalLM):
    family = "Llama 4"
    # q/k rows held in each head's rotate-half order: LoRA B rows are reordered alike.
    half_order_modules = ("q_proj", "k_proj")

    def __init__(self, config, max_positions: int) -> None:
        method = check_quant(config)
        check_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.model = Llama4Model(config, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied(config):
            self.lm_head.tie_to(self.model.embed_tokens)
        self.quant_method = method

    @staticmethod
    def sliding_window(config) -> None:
        return None

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Never folds (the worker logs why); see the module docstring."""
        return "Llama 4's layers are not Llama's (chunked attention, experts)"

    def load_weights(self, tensors) -> None:
        skip = self.skip_tensors + _VISION + (("lm_head.",) if self.tied(self.config) else ())
        if any(getattr(layer.mlp, "experts", None) is not None for layer in self.model.layers):
            tensors = _fused_experts_refused(tensors)  # the experts are quantized, one by one
        tensors = _with_half_order(tensors, head_dim_of(self.config), self.quant_method)
        load_into(self, tensors, self.stacked_params, skip, rename=_rename)
