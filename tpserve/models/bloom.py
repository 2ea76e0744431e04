"""BLOOM: ALiBi instead of rotary positions, LayerNorm (also on the word embeddings), a fused
per-head query_key_value, biases on every linear, Bloom's tanh GELU and a tied LM head.
Checkpoints name tensors with or without the "transformer." prefix (bigscience's own files
have none; transformers' save_pretrained adds it)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.layers.alibi import rank_alibi_slopes
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import VocabParallelEmbedding
from tpserve.layers.linear import RowParallelLinear
from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.layers.per_head_qkv import PerHeadQKVLinear
from tpserve.models.layernorm_lm import LayerNormCausalLM
from tpserve.models.loader import load_into


class BloomAttention(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.n_head
        self.query_key_value = PerHeadQKVLinear(hidden, heads, f"{prefix}.query_key_value")
        self.dense = RowParallelLinear(hidden, hidden, bias=True, prefix=f"{prefix}.dense")
        n, d = self.query_key_value.num_heads, self.query_key_value.head_dim
        slopes = rank_alibi_slopes(heads, f"{prefix}.query_key_value.weight")
        self.attn = PagedAttention(layer, n, n, d, 1.0 / math.sqrt(d), alibi_slopes=slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        return self.dense(self.attn(q, k, v))


class BloomBlock(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = LayerNorm(hidden, eps)
        self.self_attention = BloomAttention(config, layer, f"{prefix}.self_attention")
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.mlp = PlainMLP(hidden, 4 * hidden, "bloom_gelu", f"{prefix}.mlp",
                            names=("dense_h_to_4h", "dense_4h_to_h"))
        self.residual_after_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = (h if self.residual_after_norm else x) + self.self_attention(h)
        h = self.post_attention_layernorm(x)
        return (h if self.residual_after_norm else x) + self.mlp(h)


class BloomModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.word_embeddings_layernorm = LayerNorm(hidden, eps)
        self.h = nn.ModuleList(BloomBlock(config, i, f"transformer.h.{i}")
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings_layernorm(self.word_embeddings(ids))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class BloomForCausalLM(LayerNormCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        body = BloomModel(config)
        super().__init__(config, "transformer", body, body.word_embeddings)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(ids)  # ALiBi: positions enter through the attention kernel

    def load_weights(self, tensors) -> None:
        def rename(name: str) -> str:
            return name if name.startswith(("transformer.", "lm_head.")) \
                else f"transformer.{name}"

        skip = ("lm_head.",) if self.tied(self.config) else ()
        load_into(self, tensors, skip=skip, rename=rename)
