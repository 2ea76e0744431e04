"""BLOOM: ALiBi instead of rotary positions, LayerNorm (also on the word embeddings), a fused
per-head query_key_value, biases on every linear, Bloom's tanh GELU and a tied LM head.
Checkpoints name tensors with or without the "transformer." prefix (bigscience's own files
have none; transformers' save_pretrained adds it)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.errors import ShardingError
from tpserve.layers.activation import bloom_gelu
from tpserve.layers.alibi import rank_alibi_slopes
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpserve.layers.norm import LayerNorm
from tpserve.layers.quant.config import refuse_checkpoint_quant
from tpserve.layers.sharding import shard_size
from tpserve.models.loader import load_into
from tpserve.weights import TensorSlice


class BloomQKVLinear(ColumnParallelLinear):
    """Bloom's query_key_value stores its rows as [head, (q, k, v), head_dim], so the heads a
    rank owns are one contiguous block of rows: each rank reads its 1/tp with one narrow."""

    def __init__(self, hidden: int, num_heads: int, prefix: str) -> None:
        tp = get_tp()
        self.head_dim = hidden // num_heads
        self.num_heads = shard_size(num_heads, tp.size, tensor=f"{prefix}.weight",
                                    what="attention heads", shape=(3 * hidden, hidden))
        super().__init__(hidden, 3 * hidden, bias=True, prefix=prefix)

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        full = (3 * self.num_heads * get_tp().size * self.head_dim, *param.shape[1:])
        if tuple(w.shape) != full:
            raise ShardingError(
                f"checkpoint tensor {w.name!r} has shape {list(w.shape)}; expected {list(full)} "
                "(rows laid out as [heads, (q, k, v), head_dim]): the checkpoint does not match "
                "its config.json")
        super().load_rows(param, w)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, heads * 3 * head_dim] -> q, k, v, each [T, heads * head_dim]."""
        t = qkv.view(-1, self.num_heads, 3, self.head_dim)
        q, k, v = (t[:, :, i].reshape(qkv.shape[0], -1) for i in range(3))
        return q, k, v


class BloomAttention(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.n_head
        self.query_key_value = BloomQKVLinear(hidden, heads, f"{prefix}.query_key_value")
        self.dense = RowParallelLinear(hidden, hidden, bias=True, prefix=f"{prefix}.dense")
        n, d = self.query_key_value.num_heads, self.query_key_value.head_dim
        slopes = rank_alibi_slopes(heads, f"{prefix}.query_key_value.weight")
        self.attn = PagedAttention(layer, n, n, d, 1.0 / math.sqrt(d), alibi_slopes=slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        return self.dense(self.attn(q, k, v))


class BloomMLP(nn.Module):
    def __init__(self, hidden: int, prefix: str) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden, 4 * hidden, bias=True,
                                                  prefix=f"{prefix}.dense_h_to_4h")
        self.dense_4h_to_h = RowParallelLinear(4 * hidden, hidden, bias=True,
                                               prefix=f"{prefix}.dense_4h_to_h")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(bloom_gelu(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = LayerNorm(hidden, eps)
        self.self_attention = BloomAttention(config, layer, f"{prefix}.self_attention")
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.mlp = BloomMLP(hidden, f"{prefix}.mlp")
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


class BloomForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        refuse_checkpoint_quant("BloomForCausalLM")
        self.config = config
        self.transformer = BloomModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied(config):
            self.lm_head.tie_to(self.transformer.word_embeddings)

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(ids)  # ALiBi: positions enter through the attention kernel

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        """to_first_rank: logits on tp rank 0 only, None elsewhere (ParallelLMHead)."""
        return self.lm_head.compute_logits(hidden, to_first_rank)

    def load_weights(self, tensors) -> None:
        def rename(name: str) -> str:
            return name if name.startswith(("transformer.", "lm_head.")) \
                else f"transformer.{name}"

        skip = ("lm_head.",) if self.tied(self.config) else ()
        load_into(self, tensors, skip=skip, rename=rename)
