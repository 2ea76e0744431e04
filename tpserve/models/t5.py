"""T5, T5 v1.1 and Flan-T5 (T5ForConditionalGeneration). The encoder runs once per request
and stores every decoder layer's cross-attention K/V in the paged cache; the decoder then
runs like any decoder-only model, plus a cross attention over those K/V (docs/t5.md).

Module names mirror the checkpoint (encoder.block.0.layer.0.SelfAttention...), so loading
needs no renames; q/k/v, cross k/v and gated wi_0/wi_1 are fused per rank."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.activation import GatedActivation, get_activation
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.layers.encoder_decoder import DenseAttention, PagedCrossAttention
from tpserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant.config import refuse_checkpoint_quant
from tpserve.layers.relative_position import RelativePositionBias
from tpserve.models.loader import load_into


def scale_decoder_outputs(config) -> bool:
    """Whether the decoder output is scaled by d_model ** -0.5 before the head. Original T5
    (tied embeddings) scales, v1.1 and Flan do not; transformers >= 5 keeps the answer as
    scale_decoder_outputs, older versions read it off tie_word_embeddings."""
    scale = getattr(config, "scale_decoder_outputs", None)
    return bool(getattr(config, "tie_word_embeddings", True) if scale is None else scale)


class T5SelfAttention(nn.Module):
    """Encoder (dense, bidirectional) or decoder (paged, causal) self-attention. T5 adds a
    relative position bias instead of scaling the scores (scale 1.0); only the first layer
    of a stack owns the bias weights, every layer adds them."""

    def __init__(self, config, prefix: str, layer: int | None, has_bias: bool) -> None:
        super().__init__()
        d, heads = config.d_kv, config.num_heads
        decoder = layer is not None
        self.qkv = QKVParallelLinear(config.d_model, d, heads, heads, prefix=prefix,
                                     part_names=("q", "k", "v"))
        self.o = RowParallelLinear(heads * d, config.d_model, prefix=f"{prefix}.o")
        n = self.qkv.num_heads
        self.attn = (PagedAttention(layer, n, n, d, 1.0, relative_bias=True) if decoder
                     else DenseAttention(n, d, 1.0, relative_bias=True))
        if has_bias:
            self.relative_attention_bias = RelativePositionBias(
                config.relative_attention_num_buckets, config.relative_attention_max_distance,
                heads, bidirectional=not decoder, prefix=f"{prefix}.relative_attention_bias")

    def forward(self, x: torch.Tensor, rel_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv.split(self.qkv(x))
        return self.o(self.attn(q, k, v, rel_bias))


class T5CrossAttention(nn.Module):
    def __init__(self, config, prefix: str, layer: int) -> None:
        super().__init__()
        d, heads = config.d_kv, config.num_heads
        self.q = ColumnParallelLinear(config.d_model, heads * d, prefix=f"{prefix}.q")
        self.kv = MergedColumnParallelLinear(config.d_model, [heads * d, heads * d],
                                             prefix=prefix, part_names=["k", "v"])
        self.o = RowParallelLinear(heads * d, config.d_model, prefix=f"{prefix}.o")
        self.attn = PagedCrossAttention(layer, self.q.out_per_rank // d, d, 1.0)

    def store(self, encoder_out: torch.Tensor) -> None:
        k, v = self.kv(encoder_out).chunk(2, dim=-1)
        self.attn.store(k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.attn(self.q(x)))


class T5FeedForward(nn.Module):
    """wo(act(wi x)) (original T5, relu) or wo(act(wi_0 x) * wi_1 x) (v1.1/Flan, gelu_new)."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        d, ff = config.d_model, config.d_ff
        if config.is_gated_act:
            self.wi = MergedColumnParallelLinear(d, [ff, ff], prefix=prefix,
                                                 part_names=["wi_0", "wi_1"])
            self.act = GatedActivation(config.dense_act_fn)
        else:
            self.wi = ColumnParallelLinear(d, ff, prefix=f"{prefix}.wi")
            self.act = get_activation(config.dense_act_fn)
        self.wo = RowParallelLinear(ff, d, prefix=f"{prefix}.wo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class PreNormResidual(nn.Module):
    """x + f(layer_norm(x)), with f registered under its checkpoint name."""

    def __init__(self, config, name: str, f: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, f)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return x + getattr(self, self.name)(self.layer_norm(x), *args)


class T5Block(nn.Module):
    def __init__(self, config, prefix: str, index: int, decoder: bool,
                 own_bias: bool = False) -> None:
        """own_bias: this layer's self-attention has a position bias of its own (UMT5);
        in T5 only the first layer of a stack has one, which every layer adds."""
        super().__init__()
        layer = index if decoder else None
        parts = [PreNormResidual(config, "SelfAttention", T5SelfAttention(
            config, f"{prefix}.layer.0.SelfAttention", layer, has_bias=own_bias or index == 0))]
        if decoder:
            parts.append(PreNormResidual(config, "EncDecAttention", T5CrossAttention(
                config, f"{prefix}.layer.1.EncDecAttention", index)))
        parts.append(PreNormResidual(config, "DenseReluDense", T5FeedForward(
            config, f"{prefix}.layer.{len(parts)}.DenseReluDense")))
        self.layer = nn.ModuleList(parts)
        self.decoder = decoder

    def forward(self, x: torch.Tensor, rel_bias: torch.Tensor) -> torch.Tensor:
        x = self.layer[0](x, rel_bias)
        if self.decoder:
            x = self.layer[1](x)
        return self.layer[-1](x)


class T5Stack(nn.Module):
    def __init__(self, config, prefix: str, decoder: bool, bias_per_layer: bool = False) -> None:
        """bias_per_layer: every layer adds its own relative position bias (UMT5), not the
        first layer's (T5, mT5)."""
        super().__init__()
        n = config.num_decoder_layers if decoder else config.num_layers
        self.block = nn.ModuleList(T5Block(config, f"{prefix}.block.{i}", i, decoder,
                                           own_bias=bias_per_layer) for i in range(n))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.bias_per_layer = bias_per_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rel_bias = self.block[0].layer[0].SelfAttention.relative_attention_bias()
        for i, block in enumerate(self.block):
            if self.bias_per_layer and i:
                rel_bias = block.layer[0].SelfAttention.relative_attention_bias()
            x = block(x, rel_bias)
        return self.final_layer_norm(x)


class T5ForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    bias_per_layer = False  # UMT5: each layer's relative position bias (T5Stack)
    # (fused parameter fragment, checkpoint fragment, shard id)
    stacked_params = [
        (".SelfAttention.qkv.", ".SelfAttention.q.", "q"),
        (".SelfAttention.qkv.", ".SelfAttention.k.", "k"),
        (".SelfAttention.qkv.", ".SelfAttention.v.", "v"),
        (".EncDecAttention.kv.", ".EncDecAttention.k.", 0),
        (".EncDecAttention.kv.", ".EncDecAttention.v.", 1),
        (".DenseReluDense.wi.", ".DenseReluDense.wi_0.", 0),
        (".DenseReluDense.wi.", ".DenseReluDense.wi_1.", 1),
    ]
    # Tied copies of `shared`, and a bias some old checkpoints carry that T5 never uses.
    skip_tensors = ("encoder.embed_tokens.", "decoder.embed_tokens.",
                    "EncDecAttention.relative_attention_bias")

    def __init__(self, config, max_positions: int) -> None:
        # max_positions sizes nothing: T5's positions are relative and bucketed.
        super().__init__()
        refuse_checkpoint_quant("T5ForConditionalGeneration")
        self.config = config
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, "encoder", False, self.bias_per_layer)
        self.decoder = T5Stack(config, "decoder", True, self.bias_per_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)
        self.output_scale = config.d_model**-0.5 if self.scales_output(config) else None

    @staticmethod
    def scales_output(config) -> bool:
        return scale_decoder_outputs(config)

    def encode(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Run the encoder over this step's new prompts (laid out by the context's meta,
        whose slot_mapping points at their cross blocks) and store every decoder layer's
        cross-attention K/V there. positions are not needed: the bias is relative."""
        h = self.encoder(self.shared(ids))
        for block in self.decoder.block:
            block.layer[1].EncDecAttention.store(h)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder over this step's decoder tokens (cross K/V already stored)."""
        return self.decoder(self.shared(ids))

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        """to_first_rank: logits on tp rank 0 only, None elsewhere (ParallelLMHead)."""
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        return self.lm_head.compute_logits(hidden, to_first_rank)

    def load_weights(self, tensors) -> None:
        # transformers ties the head to `shared` unless the checkpoint has an lm_head of its
        # own (Flan does; original T5 does not). The slices are lazy: listing reads nothing.
        tensors = list(tensors)
        if tensors and not any("decoder." in t.name for t in tensors):
            # An encoder's weights alone (T5EncoderModel's, saved without `architectures`,
            # which registry.py reads to say so): the list of every missing decoder tensor
            # that load_into would give never said what the checkpoint was.
            from tpserve.errors import CheckpointError

            raise CheckpointError(
                "the checkpoint holds no decoder weights (no `decoder.*` tensors): it is an "
                "encoder alone (T5EncoderModel's; it turns text into embeddings), which cannot "
                "generate text. Serve a checkpoint of the whole model "
                f"({type(self).__name__}, with decoder weights); tpserve does not serve "
                "embeddings")
        if not any(t.name == "lm_head.weight" for t in tensors):
            self.lm_head.tie_to(self.shared)
        load_into(self, tensors, self.stacked_params, self.skip_tensors)


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    """mT5: T5 v1.1's layers (gated-gelu, an lm_head of its own) under a config class of its
    own. transformers' MT5 never scales the decoder output, and MT5Config reports
    tie_word_embeddings true whatever the file says (so scale_decoder_outputs, which falls
    back on it, would scale): the head is tied only where the file has no lm_head."""

    @staticmethod
    def scales_output(config) -> bool:
        return False


class UMT5ForConditionalGeneration(T5ForConditionalGeneration):
    """UMT5: T5 v1.1's layers, but every self-attention layer, in the encoder and the decoder,
    has a relative position bias of its own (encoder.block.{i}.layer.0.SelfAttention.
    relative_attention_bias.weight for every i) instead of reusing the first layer's.
    UMT5Config keeps scale_decoder_outputs as T5Config does."""

    bias_per_layer = True
