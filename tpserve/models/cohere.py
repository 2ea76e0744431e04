"""Cohere (CohereForCausalLM: Command-R, Command-R+, Aya 23) and Cohere 2
(Cohere2ForCausalLM: Command R7B, Command A): a parallel layer with one bias-free LayerNorm
(input_layernorm) feeding Llama's attention and gated MLP, whose outputs both join the stream
(x + attn(ln x) + mlp(ln x)), so one all-reduce a layer (row_parallel_sum). Rotary over
interleaved pairs, served as rotate-half by reordering q_proj and k_proj rows at load
(layers/interleaved_rotary.py); the logits times logit_scale; the head tied unless the config
unties it. Cohere's use_qk_norm (Command-R+): a LayerNorm over each head's query and key
with a weight per head, held by the rank that holds the head. Cohere 2: layer_types marks
sliding layers, which attend within sliding_window and rotate; the full-attention layers
use no positional embedding at all.

No norm fold: the norm is a LayerNorm (its mean does not fold into a projection) and the
MLP reads the normalised input, not the stream after attention, which forward_folded
assumes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.kernels.fused_ops import plan_unrotated
from tpserve.layers.interleaved_rotary import HalfOrderRows, half_order_rows
from tpserve.layers.linear import row_parallel_sum
from tpserve.layers.norm import HeadLayerNorm, LayerNorm
from tpserve.layers.quant.config import QuantizationError, current_quant
from tpserve.models.llama import GatedMLP, LlamaAttention, LlamaForCausalLM, head_dim_of
from tpserve.models.loader import VISION_TENSORS, decoder_names, load_into
from tpserve.weights import TensorSlice

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_norm(config) -> LayerNorm:
    return LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)


class CohereDecoderLayer(nn.Module):
    """rotary: this layer rotates queries and keys (Cohere 2's full-attention layers do
    not); qk_norm: Command-R+'s per-head norms on queries and keys, before rotary."""

    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 window: int | None, rotary: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        attn = self.self_attn = LlamaAttention(config, layer, f"{prefix}.self_attn",
                                               max_positions, window, bias=bias, o_bias=bias)
        if qk_norm:
            qkv, eps = attn.qkv_proj, config.layer_norm_eps
            attn.q_norm = HeadLayerNorm(qkv.total_heads, get_tp().rank * qkv.num_heads,
                                        qkv.num_heads, attn.head_dim, eps)
            attn.k_norm = HeadLayerNorm(qkv.total_kv_heads, qkv.kv_head_start,
                                        qkv.num_kv_heads, attn.head_dim, eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            f"{prefix}.mlp")
        self.input_layernorm = _layer_norm(config)
        self.rotary = rotary
        if not rotary:
            plan_unrotated()  # the attention backend's warmup compiles that launch too

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is the previous layer's output, added to the
        stream here; returns (attention + MLP, stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn.heads(rope if self.rotary else None, h)
        mlp = self.mlp.act.project(self.mlp.gate_up_proj, h)
        # Both branches' partial sums reduced in one all-reduce.
        return row_parallel_sum((self.self_attn.o_proj, attn), (self.mlp.down_proj, mlp)), \
            residual


def _with_half_order(tensors: Iterable[TensorSlice], head_dim: int,
                     method: str | None = None) -> Iterator:
    """The checkpoint's tensors with q_proj's and k_proj's rows (and q_norm's / k_norm's
    columns) in each head's rotate-half order (layers/interleaved_rotary.py); method: the
    checkpoint's int4 quantization (gptq, awq, compressed-tensors), whose packed q/k tensors
    are reordered along their output features, or None."""
    for w in tensors:
        if ".self_attn.q_proj." in w.name or ".self_attn.k_proj." in w.name:
            yield half_order_rows(w, head_dim, method)
        elif ".self_attn.q_norm." in w.name or ".self_attn.k_norm." in w.name:
            yield HalfOrderRows(w, head_dim, per_head_last=True)
        else:
            yield w


def _refuse_unreordered_quant(architecture: str) -> str | None:
    """The int4 method (gptq, awq, compressed-tensors) whose q/k tensors the load reorders,
    or None (float, or --quantize fp8: a cast after the reorder). Refuses the rest, before
    any shard starts: fp8 checkpoints' q/k tensors are not reordered here."""
    q = current_quant()
    if q is None or q.cast_at_load:
        return None
    if q.method in ("gptq", "awq", "compressed-tensors"):
        return q.method
    raise QuantizationError(
        f"{architecture} checkpoints quantized with {q.method} are not supported: Cohere's "
        f"q_proj / k_proj rows are reordered within each head at load (interleaved rotary), "
        f"which tpserve does for float tensors and for GPTQ, AWQ and compressed-tensors int4 "
        f"ones, not for {q.method} checkpoints. Serve the float checkpoint with --quantize fp8 "
        f"to cast its weights to e4m3 at load, or an int4 one")


class CohereForCausalLM(LlamaForCausalLM):
    # Projections whose output rows are held in each head's rotate-half order: a LoRA
    # adapter's B rows for them are reordered alike (worker/lora_loader.py).
    half_order_modules = ("q_proj", "k_proj")

    def __init__(self, config, max_positions: int) -> None:
        # The load-time reordering of q/k rows reads float rows (a cast to fp8 after it is
        # fine) and unpacks int4 ones; fp8 checkpoints are refused.
        method = _refuse_unreordered_quant(type(self).__name__)
        super().__init__(config, max_positions)
        self.quant_method = method
        scale = getattr(config, "logit_scale", None)
        self.logit_scale = None if scale is None else float(scale)

    @staticmethod
    def sliding_window(config) -> int | list[int | None] | None:
        return None  # transformers' Cohere attends over everything

    @classmethod
    def make_layer(cls, config, i: int, prefix: str, max_positions: int,
                   window: int | None) -> CohereDecoderLayer:
        return CohereDecoderLayer(config, i, prefix, max_positions, window,
                                  qk_norm=bool(getattr(config, "use_qk_norm", False)))

    @classmethod
    def model_kwargs(cls, config) -> dict:
        # Whole heads rotate: transformers' Cohere ignores a rotary_pct in config.json.
        return {"make_layer": cls.make_layer, "make_norm": lambda: _layer_norm(config),
                "rotary_fraction": 1.0}

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Never folds (the worker logs why); see the module docstring."""
        return "its norms are LayerNorms: only an RMSNorm folds"

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, to_first_rank)
        if logits is None or self.logit_scale is None:
            return logits
        return logits * self.logit_scale

    def load_weights(self, tensors) -> None:
        skip = self.skip_tensors + VISION_TENSORS + \
            (("lm_head.",) if self.tied(self.config) else ())
        tensors = _with_half_order(tensors, head_dim_of(self.config), self.quant_method)
        load_into(self, tensors, self.stacked_params, skip, rename=decoder_names("model."))


def cohere2_windows(config) -> list[int | None]:
    """Each layer's window: sliding_window on the layers layer_types marks sliding (three
    in four, by transformers' default sliding_window_pattern 4), None on the others."""
    types = list(config.layer_types)
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"Cohere2 config.json layer_types must list one of {', '.join(_LAYER_TYPES)} per "
            f"layer ({config.num_hidden_layers}); it has {len(types)} entries"
            + (f" including {unknown}" if unknown else "") + ": fix the checkpoint's config")
    window = getattr(config, "sliding_window", None) or None
    return [window if t == "sliding_attention" else None for t in types]


class Cohere2ForCausalLM(CohereForCausalLM):
    @staticmethod
    def sliding_window(config) -> list[int | None]:
        return cohere2_windows(config)

    @classmethod
    def make_layer(cls, config, i: int, prefix: str, max_positions: int,
                   window: int | None) -> CohereDecoderLayer:
        # transformers' Cohere2 rotates exactly where it windows (and has no q/k norms).
        return CohereDecoderLayer(config, i, prefix, max_positions, window,
                                  rotary=window is not None)
