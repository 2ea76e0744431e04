"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B): a fused query_key_value laid out
per head ([head, (q, k, v), head_dim], as Bloom's) with rotary on the first rotary_pct of
each head's dimensions, LayerNorms with biases, a plain MLP dense_h_to_4h -> act ->
dense_4h_to_h with biases, and an untied head `embed_out`. With use_parallel_residual
(Pythia, 20B) attention and MLP both read the layer's input, each through its own norm, and
both outputs join the stream; without it the MLP reads the stream after attention.

No norm fold and no fused residual-add + RMSNorm: the norms are LayerNorms (mean and bias
do not fold into a projection), and a parallel layer adds two branches to a stream that
neither norm sees summed (fold_norms says so)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import VocabParallelEmbedding
from tpserve.layers.linear import RowParallelLinear, row_parallel_sum
from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.layers.per_head_qkv import PerHeadQKVLinear
from tpserve.layers.rotary import RotaryEmbedding, partial_rotary_factor, rope_parameters
from tpserve.models.layernorm_lm import LayerNormCausalLM
from tpserve.models.loader import load_into, with_prefix

Rope = tuple[torch.Tensor, torch.Tensor]


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", True))
        self.query_key_value = PerHeadQKVLinear(hidden, config.num_attention_heads,
                                                f"{prefix}.query_key_value", bias=bias)
        self.dense = RowParallelLinear(hidden, hidden, bias=bias, prefix=f"{prefix}.dense")
        n, d = self.query_key_value.num_heads, self.query_key_value.head_dim
        self.attn = PagedAttention(layer, n, n, d, d**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.heads(rope, x))

    def heads(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention output, before `dense`."""
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        return self.attn(q, k, v, rope=rope)


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.attention = GPTNeoXAttention(config, layer, f"{prefix}.attention")
        self.mlp = PlainMLP(hidden, config.intermediate_size, config.hidden_act, f"{prefix}.mlp",
                            names=("dense_h_to_4h", "dense_4h_to_h"))
        self.parallel_residual = bool(config.use_parallel_residual)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            # Both branches' partial sums reduced in one all-reduce (row_parallel_sum).
            attn = self.attention.heads(rope, self.input_layernorm(x))
            mlp = self.mlp.hidden(self.post_attention_layernorm(x))
            return row_parallel_sum((self.attention.dense, attn), (self.mlp.down, mlp)) + x
        x = self.attention(rope, self.input_layernorm(x)) + x
        return self.mlp(self.post_attention_layernorm(x)) + x


class GPTNeoXModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_in = VocabParallelEmbedding(config.vocab_size, hidden)
        self.rotary = RotaryEmbedding(hidden // config.num_attention_heads, max_positions,
                                      rope_parameters(config), partial_rotary_factor(config))
        self.layers = nn.ModuleList(GPTNeoXLayer(config, i, f"gpt_neox.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(hidden, config.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(rope, x)
        return self.final_layer_norm(x)


class GPTNeoXForCausalLM(LayerNormCausalLM):
    tied_by_default = False
    head_name = "embed_out"

    def __init__(self, config, max_positions: int) -> None:
        body = GPTNeoXModel(config, max_positions)
        super().__init__(config, "gpt_neox", body, body.embed_in)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.gpt_neox(ids, positions)

    def load_weights(self, tensors) -> None:
        # A body saved from GPTNeoXModel names its tensors "layers.0...", "embed_in.weight":
        # transformers adds the base model's prefix, and so does tpserve.
        prefixed = with_prefix("gpt_neox.", keep=("embed_out.",))

        def rename(name: str) -> str:
            # EleutherAI's files name the head embed_out; transformers 5 calls it lm_head in
            # memory and writes that name with save_pretrained(save_original_format=False).
            if name.startswith("lm_head."):
                return "embed_out." + name.removeprefix("lm_head.")
            return prefixed(name)

        # attention.bias / masked_bias: the causal mask buffers older files carry.
        skip = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")
        skip += ("embed_out.", "lm_head.") if self.tied(self.config) else ()
        load_into(self, tensors, skip=skip, rename=rename)
