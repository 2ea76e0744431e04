"""DeepSeek-V2 (V2, V2-Lite, V2.5) and DeepSeek-V3 (V3, R1): multi-head latent attention
(layers/mla.py) and, from layer first_k_dense_replace on, a sparse block of routed and shared
experts (models/deepseek_moe.py); the first layers keep a gated MLP of intermediate_size.
Llama's residual stream, RMSNorms and head otherwise. The multi-token-prediction layers a
V3 checkpoint may carry (layers num_hidden_layers onwards) are not read. Quantized
checkpoints (GPTQ, AWQ, compressed-tensors, fp8) load through the layers' methods, the
routed experts one by one (layers/moe.py QuantizedExpert), the routers float."""

from __future__ import annotations

import re

from torch import nn

from tpserve.layers.mla import MLAttention
from tpserve.models.deepseek_moe import DeepseekMoE
from tpserve.models.experts import ExpertTensors
from tpserve.models.llama import (
    GatedMLP,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    head_dim_of,
    rms_norm_maker,
)

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (forward: norm, attention, norm, MLP) around MLA attention. Its own
    type, so fold_norms refuses it (there is no qkv_proj to fold the input norm into)."""

    def __init__(self, config, layer: int, prefix: str, mlp: nn.Module | None,
                 interleaved: bool) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer.__init__ would build Llama's attention
        self.self_attn = MLAttention(config, layer, f"{prefix}.self_attn", interleaved)
        self.mlp = mlp if mlp is not None else GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, f"{prefix}.mlp")
        make_norm = rms_norm_maker(config)
        self.input_layernorm, self.post_attention_layernorm = make_norm(), make_norm()
        self.residual_scale = 1.0


def _refuse(family: str, option: str, value, rule: str) -> None:
    raise ValueError(f"{family} config.json sets {option} = {value!r}: {rule}")


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    family = "DeepSeek-V2"
    version = 2
    stacked_params = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, config, max_positions: int) -> None:
        self.check_config(config)
        super().__init__(config, max_positions)

    @classmethod
    def check_config(cls, config) -> None:
        if head_dim_of(config) != config.qk_rope_head_dim:
            _refuse(cls.family, "head_dim", head_dim_of(config),
                    f"transformers rotates qk_rope_head_dim = {config.qk_rope_head_dim} "
                    "dimensions with a table of head_dim; a config.json where the two differ "
                    "is not one transformers writes")
        if (getattr(config, "moe_layer_freq", 1) or 1) != 1:
            _refuse(cls.family, "moe_layer_freq", config.moe_layer_freq,
                    "transformers makes every layer from first_k_dense_replace on sparse "
                    "(moe_layer_freq 1, as every released checkpoint has); tpserve matches it")
        if cls.version == 2:
            method = getattr(config, "topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                _refuse(cls.family, "topk_method", method,
                        "DeepSeek-V2's router is 'greedy' or 'group_limited_greedy'")
            if getattr(config, "norm_topk_prob", False):
                _refuse(cls.family, "norm_topk_prob", True,
                        "transformers' DeepSeek-V2 router does not renormalise the top-k "
                        "weights; the released V2 checkpoints set it false")
        else:
            method = getattr(config, "topk_method", None)
            if method not in (None, "noaux_tc"):
                _refuse(cls.family, "topk_method", method,
                        "DeepSeek-V3's router is 'noaux_tc' (transformers runs no other)")
            scoring = getattr(config, "scoring_func", None)
            if scoring not in (None, "sigmoid"):
                _refuse(cls.family, "scoring_func", scoring,
                        "DeepSeek-V3's router scores by sigmoid (transformers runs no other)")

    @classmethod
    def model_kwargs(cls, config) -> dict:
        def make_layer(config, i, prefix, max_positions, window):
            sparse = config.n_routed_experts and i >= (config.first_k_dense_replace or 0)
            mlp = DeepseekMoE(config, f"{prefix}.mlp", cls.version) if sparse else None
            return DeepseekDecoderLayer(config, i, prefix, mlp, interleaved)
        # transformers' V2 always rotates interleaved pairs; V3 as rope_interleave says.
        interleaved = cls.version == 2 or bool(getattr(config, "rope_interleave", True))
        return {"make_layer": make_layer}

    @staticmethod
    def sliding_window(config) -> None:
        return None

    def load_weights(self, tensors) -> None:
        n = self.config.num_hidden_layers
        main = (w for w in tensors if not ((m := _LAYER.match(w.name)) and int(m[1]) >= n))
        experts = ExpertTensors(self.model.layers)
        super().load_weights(experts.others(main))
        experts.check()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    family = "DeepSeek-V3"
    version = 3
