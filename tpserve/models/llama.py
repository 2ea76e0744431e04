"""Llama and Mistral (and the other Llama-shaped decoders that reuse these blocks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpserve.layers.activation import GatedActivation
from tpserve.layers.attention import PagedAttention
from tpserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant.methods import Int4Method, UnquantizedMethod
from tpserve.layers.rotary import (
    RotaryEmbedding,
    layer_rope_parameters,
    partial_rotary_factor,
    rope_parameters,
)
from tpserve.models.loader import VISION_TENSORS, decoder_names, load_into


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """qk_norm: the weight offset of an RMSNorm over each head's query and key before rotary
    (0.0: Qwen3's; 1.0: Gemma 3's (1 + w) in float32); None: none. Its weight of head_dim
    values is shared by the heads, so every rank holds it whole. fused_on_disk: the
    checkpoint stores q, k, v as one qkv_proj (Phi-3), which a sharding refusal names."""

    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 sliding_window: int | None = None, bias: bool = False, o_bias: bool = False,
                 softcap: float | None = None, scale: float | None = None,
                 qk_norm: float | None = None, fused_on_disk: bool = False,
                 sinks: bool = False) -> None:
        """sinks: a learned logit per head in each softmax's denominator (gpt-oss), loaded
        as self_attn.sinks (the family's rename maps it onto attn.sinks)."""
        super().__init__()
        d = self.head_dim = head_dim_of(config)
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads, kv,
                                          bias=bias, prefix=prefix,
                                          disk_name="qkv_proj" if fused_on_disk else None)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias=o_bias,
                                        prefix=f"{prefix}.o_proj")
        self.attn = PagedAttention(layer, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d,
                                   scale if scale is not None else d**-0.5,
                                   sliding_window=sliding_window, softcap=softcap, sinks=sinks)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            eps = getattr(config, "rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(d, eps, qk_norm, qk_norm == 0.0)
            self.k_norm = RMSNorm(d, eps, qk_norm, qk_norm == 0.0)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                rms_eps: float | None = None) -> torch.Tensor:
        """rms_eps: x is the residual stream, normalised inside qkv_proj (the input norm
        folded into it, LlamaDecoderLayer.forward_folded)."""
        return self.o_proj(self.heads(rope, x, rms_eps))

    def heads(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
              rms_eps: float | None = None) -> torch.Tensor:
        """This rank's heads' attention output, before o_proj (for a layer that reduces
        o_proj's partial sums together with another branch's: Phi)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, rms_eps))
        if self.q_norm is not None:
            d = self.head_dim
            q = self.q_norm(q.reshape(-1, d)).view(q.shape)
            k = self.k_norm(k.reshape(-1, d)).view(k.shape)
        return self.attn(q, k, v, rope=rope)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, prefix: str,
                 bias: bool = False, fused_on_disk: bool = False) -> None:
        """fused_on_disk: the checkpoint stores gate and up as one gate_up_proj (Phi-3)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=bias, prefix=prefix,
            part_names=["gate_proj", "up_proj"], what="intermediate size",
            disk_name="gate_up_proj" if fused_on_disk else None)
        self.act = GatedActivation(act)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias,
                                           prefix=f"{prefix}.down_proj")
        self.act.fuse_with(self.gate_up_proj)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: returns residual + the MLP's output (added inside down_proj's launch
        where it can be)."""
        return self.down_proj(self.act.project(self.gate_up_proj, x), residual)


def rms_norm_maker(config, norm_offset: float = 0.0):
    """The RMSNorm of a Llama-shaped family: Llama casts before the weight, Gemma's (1 + w)
    multiplies in float32."""
    eps = getattr(config, "rms_norm_eps", 1e-6)
    return lambda: RMSNorm(config.hidden_size, eps, norm_offset, norm_offset == 0.0)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 sliding_window: int | None = None, norm_offset: float = 0.0,
                 qkv_bias: bool = False, o_bias: bool = False, act: str | None = None,
                 qk_norm: float | None = None,
                 mlp: nn.Module | Callable[[], nn.Module] | None = None,
                 attn_scale: float | None = None, residual_scale: float = 1.0,
                 make_norm=None, fused_on_disk: bool = False, attn_sinks: bool = False) -> None:
        """mlp: the feed-forward block (Mixtral's experts, StarCoder2's plain MLP), or a
        function that builds it after the attention (so a tp the heads cannot take is
        refused naming q_proj before the MLP's rule: Nemotron); the default is a GatedMLP.
        attn_scale: the attention scores' scale (Granite's
        attention_multiplier); None: 1 / sqrt(head_dim). residual_scale: each branch's
        output is multiplied by it before it joins the residual stream (Granite's
        residual_multiplier). make_norm: builds the two norms (StarCoder2's LayerNorm); the
        default is the family's RMSNorm (rms_norm_maker), the only norm fold_norms folds.
        fused_on_disk: the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3).
        attn_sinks: attention sinks (gpt-oss, LlamaAttention)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, f"{prefix}.self_attn", max_positions,
                                        sliding_window, bias=qkv_bias, o_bias=o_bias,
                                        scale=attn_scale, qk_norm=qk_norm,
                                        fused_on_disk=fused_on_disk, sinks=attn_sinks)
        act = act or getattr(config, "hidden_activation", None) or config.hidden_act
        if mlp is not None and not isinstance(mlp, nn.Module):
            mlp = mlp()
        self.mlp = mlp if mlp is not None else GatedMLP(
            config.hidden_size, config.intermediate_size, act, f"{prefix}.mlp",
            bias=getattr(config, "mlp_bias", False), fused_on_disk=fused_on_disk)
        make_norm = make_norm or rms_norm_maker(config, norm_offset)
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()
        self.residual_scale = float(residual_scale)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the add is
        fused into the norm). Returns (this layer's MLP output, residual stream). Both
        branches are scaled here, before the norm that adds them, so the fused add never
        sees an unscaled branch."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self._scaled(self.self_attn(rope, h))
        h, residual = self.post_attention_layernorm(attn, residual)
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        # A Python float, as transformers multiplies (Granite: residual + h * multiplier).
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale

    def forward_folded(self, rope: tuple[torch.Tensor, torch.Tensor],
                       h: torch.Tensor) -> torch.Tensor:
        """One row of the residual stream in, the next out, with the input norm folded into
        qkv_proj (fold_norms), which normalises the stream as it reads it, and the MLP's
        output added to the stream inside down_proj's launch: one norm launch a layer
        instead of two. The norm after attention stays a launch: normalising inside the
        gated [gate; up] GEMV cost its many small programs more than the launch saves."""
        attn = self.self_attn(rope, h, rms_eps=self.input_layernorm.eps)
        x, h = self.post_attention_layernorm(attn, h)
        return self.mlp(x, residual=h)

    def why_not_foldable(self, need_gemv: bool, dtype: torch.dtype) -> str | None:
        """None when fold_norms can run here, else why not. need_gemv: qkv_proj and
        down_proj must also have one-row launches that normalise and add for free (for
        float weights the GEMV warmup chose, for int4 the kernel's; fp8 has none); through
        F.linear the fold would trade each norm launch for another."""
        mlp = self.mlp
        if type(self.input_layernorm) is not RMSNorm:
            return f"its norms are {type(self.input_layernorm).__name__}s: only an RMSNorm folds"
        if self.residual_scale != 1.0:
            # forward_folded adds the MLP's output to the stream inside down_proj's launch,
            # which cannot scale it first (Granite's residual_multiplier).
            return f"its branches are scaled by {self.residual_scale} before the residual add"
        if type(mlp) is not GatedMLP:
            return f"its feed-forward block is a {type(mlp).__name__}, not a gated MLP"
        projs = {"qkv_proj": self.self_attn.qkv_proj, "down_proj": mlp.down_proj}
        for name, proj in projs.items():
            if not isinstance(proj.method, (UnquantizedMethod, Int4Method)):
                return f"{name} holds {type(proj.method).__name__} weights"
        if mlp.down_proj.tp_size != 1 or mlp.down_proj.bias is not None:
            return "down_proj is split over ranks or has a bias: its add is a launch of its own"
        if need_gemv:
            for name, proj in projs.items():
                why = proj.method.why_not_fused_one_row(proj, dtype, normed=name == "qkv_proj")
                if why:
                    return f"{name}: {why}"
        return None

    def fold_norms(self) -> None:
        """The input norm into qkv_proj (forward_folded): its weight into float weights,
        or kept for int4's GEMV to apply (LinearMethod.fold_norm)."""
        qkv = self.self_attn.qkv_proj
        qkv.method.fold_norm(qkv, self.input_layernorm)


class LlamaModel(nn.Module):
    """sliding_window: one window for every layer, or a list with one entry per layer.
    make_layer(config, index, prefix, max_positions, window) builds a decoder layer of
    another shape (Gemma 2's four norms); the default is LlamaDecoderLayer, given
    attn_scale and residual_scale. make_norm builds the final norm (and the default layer's).
    rotary_fraction: the share of each head that rotates where the family fixes it (Cohere
    rotates whole heads whatever rotary_pct its config.json carries); None: the config's."""

    def __init__(self, config, max_positions: int,
                 sliding_window: int | list[int | None] | None = None, norm_offset: float = 0.0,
                 qkv_bias: bool = False, o_bias: bool = False, act: str | None = None,
                 qk_norm: float | None = None, make_layer=None, attn_scale: float | None = None,
                 residual_scale: float = 1.0, make_norm=None,
                 fused_on_disk: bool = False, rotary_fraction: float | None = None) -> None:
        super().__init__()
        make_norm = make_norm or rms_norm_maker(config, norm_offset)
        if make_layer is None:
            def make_layer(config, i, prefix, max_positions, window):
                return LlamaDecoderLayer(config, i, prefix, max_positions, window, norm_offset,
                                         qkv_bias, o_bias, act, qk_norm, attn_scale=attn_scale,
                                         residual_scale=residual_scale, make_norm=make_norm,
                                         fused_on_disk=fused_on_disk)
        n = config.num_hidden_layers
        windows = sliding_window if isinstance(sliding_window, list) else [sliding_window] * n
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = rope_parameters(config)
        partial = partial_rotary_factor(config) if rotary_fraction is None else rotary_fraction
        # One table for every layer, or one per layer type where the config gives each its
        # own (Gemma 3); each step gathers each table's cos/sin once (forward).
        by_type = layer_rope_parameters(config)
        if by_type is None:
            by_type, self.rope_of_layer = {"all": rope}, ["all"] * n
        else:
            self.rope_of_layer = list(config.layer_types)
        self.rotaries = nn.ModuleDict({
            t: RotaryEmbedding(head_dim_of(config), max_positions, p, partial)
            for t, p in by_type.items()})
        self.layers = nn.ModuleList(
            make_layer(config, i, f"model.layers.{i}", max_positions, windows[i])
            for i in range(n)
        )
        self.norm = make_norm()
        # Set by the family: Gemma's sqrt(hidden) rounded to the model dtype first
        # (round_embed_scale), Granite's embedding_multiplier as a Python float.
        self.embed_scale: float | None = None
        self.round_embed_scale = True
        self._embed_scales: dict[torch.dtype, float] = {}  # _rounded_embed_scale
        self.norms_folded = False  # fold_norms

    @property
    def long_rope_offset(self) -> int | None:
        """longrope: the rotary row of the long factors' position 0 (the worker shifts a
        long sequence's positions by it); None for other rope types."""
        offsets = {r.long_offset for r in self.rotaries.values()}
        if len(offsets) > 1:
            raise ValueError(f"rotary tables of different longrope offsets {offsets}")
        return offsets.pop()

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Fold every decoder layer's input norm into its QKV projection, so that one-row
        steps (a single stream's decode) skip half the norm launches
        (LlamaDecoderLayer.forward_folded); None when done (or done before), else why not
        (nothing changed). All layers or none. Run once the weights are loaded and warmup
        has chosen the one-row kernels, before graphs are captured."""
        if self.norms_folded:
            return None
        for i, layer in enumerate(self.layers):
            if type(layer) is not LlamaDecoderLayer:
                return f"layer {i} is a {type(layer).__name__}"
            why = layer.why_not_foldable(need_gemv, self.embed_tokens.weight.dtype)
            if why:
                return f"layer {i}: {why}"
        for layer in self.layers:
            layer.fold_norms()
        self.norms_folded = True
        return None

    def _rounded_embed_scale(self, dtype: torch.dtype) -> float:
        """Gemma's float32 scale rounded to the model dtype before multiplying, as a Python
        float: the same product as a tensor of it, without the host-to-device copy a tensor
        built per forward made (which CUDA graph capture refuses: Gemma failed start-up on
        CUDA)."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = torch.tensor(
                self.embed_scale, dtype=torch.float32).to(dtype).item()
        return self._embed_scales[dtype]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if self.embed_scale is not None and self.round_embed_scale:
            x = x * self._rounded_embed_scale(x.dtype)
        elif self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = {t: r.cos_sin(positions, x.dtype) for t, r in self.rotaries.items()}
        if self.norms_folded and ids.numel() == 1:
            for layer, rope in zip(self.layers, self.rope_of_layer, strict=True):
                x = layer.forward_folded(ropes[rope], x)
            return self.norm(x)
        residual = None
        for layer, rope in zip(self.layers, self.rope_of_layer, strict=True):
            x, residual = layer(ropes[rope], x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # (fused parameter fragment, checkpoint fragment, shard id)
    stacked_params = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    skip_tensors = ("rotary_emb.inv_freq",)
    # Whether the family rotates the first partial_rotary_factor of each head, as
    # transformers' Phi, Phi-3 and Nemotron do. transformers' Llama, Mistral, Gemma, Qwen ...
    # rotate whole heads and leave a partial_rotary_factor in config.json unread.
    reads_partial_rotary = False

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        whole = {} if self.reads_partial_rotary else {"rotary_fraction": 1.0}
        self.model = LlamaModel(config, max_positions, self.sliding_window(config),
                                **{**whole, **self.model_kwargs(config)})
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied(config):
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def sliding_window(config) -> int | list[int | None] | None:
        return getattr(config, "sliding_window", None) or None

    @staticmethod
    def model_kwargs(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", False))

    @property
    def long_rope_offset(self) -> int | None:
        return self.model.long_rope_offset

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(ids, positions)

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        return self.model.fold_norms(need_gemv)

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        """to_first_rank: logits on tp rank 0 only, None elsewhere (ParallelLMHead)."""
        return self.lm_head.compute_logits(hidden, to_first_rank)

    def load_weights(self, tensors) -> None:
        # VISION_TENSORS: a vision-language checkpoint served as text (Llava, Mistral 3,
        # Qwen2-VL) names its language model's tensors as decoder_names maps them.
        skip = self.skip_tensors + VISION_TENSORS + \
            (("lm_head.",) if self.tied(self.config) else ())
        load_into(self, tensors, self.stacked_params, skip, rename=decoder_names("model."))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (config.sliding_window; None disables it)."""
