"""Falcon (FalconForCausalLM; RWForCausalLM, the label of the first releases, where a
`falcon` config carries it): Falcon-7B / 40B / 180B / 11B and Falcon-RW-1B / 7B. LayerNorms
with biases, a plain MLP dense_h_to_4h -> activation -> dense_4h_to_h of ffn_hidden_size,
`self_attention.dense`, biases on every linear only with `bias`, a head tied to
`word_embeddings` unless tie_word_embeddings says otherwise, names under `transformer.`.

The fused query_key_value is grouped by KV head (GroupedQKVLinear), in three shapes:
new_decoder_architecture (40B, 180B, 11B): num_kv_heads groups of [their q heads, k, v];
multi_query (7B): one KV head, [q (all heads); k; v]; neither (RW): [head, (q, k, v)].

Layers: with new_decoder_architecture or parallel_attn, attention and MLP both read the
layer's input, through ln_attn and ln_mlp (num_ln_in_parallel_attn 2, new architecture's
default) or one input_layernorm, and their outputs join the stream together (one
all-reduce, row_parallel_sum); otherwise (RW) input_layernorm -> attention, then
post_attention_layernorm -> MLP, one after the other.

Positions: rotary over whole heads (rope_parameters), or with `alibi` (RW) ALiBi whose
slopes transformers rounds to bfloat16 and divides by sqrt(head_dim) (as the scores are):
served as those slopes. transformers also rounds each key position, and the slope x
position product, to bfloat16, which the kernels (slope x distance in float32) do not: the
same bias for at most 8 heads (power-of-two slopes) below position 256, within 2^-7 of it
(one bfloat16 step) otherwise; past 256 transformers gives runs of neighbouring positions
one bias (8 positions near 2048), tpserve each its own.

Combinations transformers' Falcon cannot run are refused while the model is built."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.alibi import rank_alibi_slopes
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import VocabParallelEmbedding
from tpserve.layers.linear import RowParallelLinear, row_parallel_sum
from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.layers.per_head_qkv import GroupedQKVLinear
from tpserve.layers.rotary import RotaryEmbedding, rope_parameters
from tpserve.models.gpt_neox import GPTNeoXAttention
from tpserve.models.layernorm_lm import LayerNormCausalLM
from tpserve.models.loader import load_into, with_prefix

Rope = tuple[torch.Tensor, torch.Tensor] | None


def kv_heads(config) -> int:
    """The KV heads of query_key_value, as transformers' FalconAttention counts them."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def norms_in_parallel(config) -> int:
    """1 or 2 LayerNorms in front of a parallel layer (2 by default with the new
    architecture, as transformers sets it)."""
    n = getattr(config, "num_ln_in_parallel_attn", None)
    return (2 if config.new_decoder_architecture else 1) if n is None else int(n)


def check_falcon_config(config) -> None:
    """Refuse what transformers' Falcon cannot build or run, naming the config field."""
    def refuse(field: str, value, why: str) -> ValueError:
        return ValueError(f"Falcon config.json sets {field} = {value!r}: {why}; tpserve serves "
                          "Falcon as transformers runs it, so this checkpoint is refused")

    if config.new_decoder_architecture and not config.parallel_attn:
        raise refuse("parallel_attn", config.parallel_attn,
                     "with new_decoder_architecture the layer is always parallel (ln_attn / "
                     "ln_mlp), and transformers' Falcon fails on this combination")
    if config.new_decoder_architecture or config.parallel_attn:
        if norms_in_parallel(config) not in (1, 2):
            raise refuse("num_ln_in_parallel_attn", config.num_ln_in_parallel_attn,
                         "a parallel layer has 1 or 2 LayerNorms")
        if not config.new_decoder_architecture and norms_in_parallel(config) == 2:
            raise refuse("num_ln_in_parallel_attn", config.num_ln_in_parallel_attn,
                         "two LayerNorms (ln_attn, ln_mlp) need new_decoder_architecture; "
                         "transformers' older Falcon layer reads input_layernorm only")
    if (not config.new_decoder_architecture and not config.multi_query
            and config.num_kv_heads != config.num_attention_heads):
        raise refuse("num_kv_heads", config.num_kv_heads,
                     f"without new_decoder_architecture or multi_query, query_key_value holds "
                     f"a key and value per query head ({config.num_attention_heads})")


def falcon_alibi_slopes(heads: int, head_dim: int, tensor: str = "alibi") -> torch.Tensor:
    """This rank's ALiBi slopes as Falcon scales them: transformers multiplies bfloat16
    slopes by the key positions and divides the bias by sqrt(head_dim), as the scores are
    (the kernels add slope x distance after scaling the scores)."""
    return rank_alibi_slopes(heads, tensor).bfloat16().float() * head_dim**-0.5


class FalconAttention(GPTNeoXAttention):
    """GPT-NeoX's attention (forward, heads) over Falcon's grouped query_key_value."""

    def __init__(self, config, layer: int, prefix: str) -> None:
        nn.Module.__init__(self)  # GPTNeoXAttention.__init__ would build its per-head qkv
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, bool(config.bias)
        d = hidden // heads
        self.query_key_value = GroupedQKVLinear(hidden, d, heads, kv_heads(config), bias, prefix)
        self.dense = RowParallelLinear(hidden, hidden, bias=bias, prefix=f"{prefix}.dense")
        slopes = falcon_alibi_slopes(heads, d, f"{prefix}.query_key_value.weight") \
            if config.alibi else None
        qkv = self.query_key_value
        self.attn = PagedAttention(layer, qkv.num_heads, qkv.num_kv_heads, d, d**-0.5,
                                   alibi_slopes=slopes)


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = FalconAttention(config, layer, f"{prefix}.self_attention")
        self.mlp = PlainMLP(hidden, getattr(config, "ffn_hidden_size", None) or 4 * hidden,
                            config.activation, f"{prefix}.mlp",
                            names=("dense_h_to_4h", "dense_4h_to_h"), bias=bool(config.bias))
        self.parallel = bool(config.new_decoder_architecture or config.parallel_attn)
        if self.parallel and norms_in_parallel(config) == 2:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            x = self.self_attention(rope, self.input_layernorm(x)) + x
            return self.mlp(self.post_attention_layernorm(x)) + x
        if hasattr(self, "ln_attn"):
            h, m = self.ln_attn(x), self.ln_mlp(x)
        else:
            h = m = self.input_layernorm(x)
        # Both branches' partial sums reduced in one all-reduce.
        attn, mlp = self.self_attention.heads(rope, h), self.mlp.hidden(m)
        return row_parallel_sum((self.self_attention.dense, attn), (self.mlp.down, mlp)) + x


class FalconModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.rotary = None if config.alibi else RotaryEmbedding(
            hidden // config.num_attention_heads, max_positions, rope_parameters(config))
        self.h = nn.ModuleList(FalconDecoderLayer(config, i, f"transformer.h.{i}")
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)
        # ALiBi: positions enter through the attention kernel.
        rope = None if self.rotary is None else self.rotary.cos_sin(positions, x.dtype)
        for layer in self.h:
            x = layer(rope, x)
        return self.ln_f(x)


class FalconForCausalLM(LayerNormCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        check_falcon_config(config)
        body = FalconModel(config, max_positions)
        super().__init__(config, "transformer", body, body.word_embeddings)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(ids, positions)

    def load_weights(self, tensors) -> None:
        # inv_freq: the rotary buffer the first (remote-code) releases saved in their files.
        skip = (".inv_freq",) + (("lm_head.",) if self.tied(self.config) else ())
        load_into(self, tensors, skip=skip, rename=with_prefix("transformer."))
