"""GPTBigCode (GPTBigCodeForCausalLM: StarCoder, StarCoderBase, SantaCoder, WizardCoder,
granite-*-code-base 20B / 34B): GPT-2's block with multi-query attention. Learned absolute
positions (`wpe`, n_positions rows) added to the word embeddings, LayerNorms `ln_1`, `ln_2`,
`ln_f` with biases, a plain MLP c_fc -> activation_function -> c_proj, biases on every
linear, no rotary, and a head tied to `wte` unless tie_word_embeddings says otherwise.
Every weight is an nn.Linear's [out, in] (none of GPT-2's transposed Conv1D).

The fused `attn.c_attn`: with multi_query (every released model) one key/value head serves
all query heads and its rows are [q (hidden); k (head_dim); v (head_dim)]: each rank takes
its query heads' rows and the whole k and v (QKVParallelLinear replicates a KV head when
tp exceeds them). Without it, the rows are laid out per head, [head, (q, k, v), head_dim],
as Bloom's (PerHeadQKVLinear). Scores are scaled by 1/sqrt(head_dim) with
scale_attn_weights, else not at all.

Positions past n_positions have no embedding, so a longer --max-total-tokens is refused
while the model is built (on the meta device, before any shard starts). No norm fold
(LayerNorms). Quantized checkpoints (GPTQ, AWQ, fp8, compressed-tensors) load through the
linears' methods as the Llama-shaped families' do."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from tpserve.layers.linear import QKVParallelLinear, RowParallelLinear
from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.layers.per_head_qkv import PerHeadQKVLinear
from tpserve.models.layernorm_lm import LayerNormCausalLM
from tpserve.models.loader import load_into, with_prefix


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        d = hidden // heads
        if config.multi_query:
            self.c_attn = QKVParallelLinear(hidden, d, heads, 1, bias=True, prefix=prefix,
                                            disk_name="c_attn")
            kv_heads = self.c_attn.num_kv_heads
        else:
            self.c_attn = PerHeadQKVLinear(hidden, heads, f"{prefix}.c_attn")
            kv_heads = self.c_attn.num_heads
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, prefix=f"{prefix}.c_proj")
        scale = d**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        self.attn = PagedAttention(layer, self.c_attn.num_heads, kv_heads, d, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(x))
        return self.c_proj(self.attn(q, k, v))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = GPTBigCodeAttention(config, layer, f"{prefix}.attn")
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = PlainMLP(hidden, config.n_inner or 4 * hidden, config.activation_function,
                            f"{prefix}.mlp", names=("c_fc", "c_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x)) + x
        return self.mlp(self.ln_2(x)) + x


class GPTBigCodeModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden)
        self.wpe = ReplicatedEmbedding(config.max_position_embeddings, hidden)
        self.h = nn.ModuleList(GPTBigCodeBlock(config, i, f"transformer.h.{i}")
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPTBigCodeForCausalLM(LayerNormCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        limit = config.max_position_embeddings
        if max_positions > limit:
            raise ValueError(
                f"GPTBigCode learns one embedding per position (transformer.wpe.weight, "
                f"n_positions = {limit}) and has none past it; tpserve serves this model up to "
                f"{limit} tokens: pass --max-total-tokens {limit} or less "
                f"(asked for {max_positions})")
        body = GPTBigCodeModel(config)
        super().__init__(config, "transformer", body, body.wte)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(ids, positions)

    def load_weights(self, tensors) -> None:
        skip = ("lm_head.",) if self.tied(self.config) else ()
        load_into(self, tensors, skip=skip, rename=with_prefix("transformer."))
