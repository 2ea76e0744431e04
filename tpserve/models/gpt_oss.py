"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b): Llama's layer with biases on q, k, v and o,
GQA with head_dim 64, attention sinks (a learned logit per head in each softmax's
denominator, kernels/base.py), a window of sliding_window on the layers config.layer_types
marks "sliding_attention" (every other one, the first included), YaRN rotary, an RMSNorm
that multiplies its weight in float32, and a mixture of experts with a biased router and a
clamped SwiGLU in place of the MLP (layers/gpt_oss_moe.py).

Checkpoints: bf16 (the experts as gate_up_proj / down_proj and their biases) or the released
MXFP4 ones (quantization_config.quant_method "mxfp4": gate_up_proj_blocks / _scales and
down_proj_blocks / _scales), whose experts each rank dequantizes, its own slice only, into
the model dtype as it loads them (layers/quant/mxfp4.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from tpserve.errors import CheckpointError
from tpserve.layers.gpt_oss_moe import GptOssMoE
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant.config import refuse_checkpoint_quant
from tpserve.models.gemma2 import layer_windows
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tpserve.models.loader import load_into, with_prefix
from tpserve.weights import TensorSlice

# Checkpoint names of the expert tensors -> GptOssMoE's parameters (under ".mlp.").
_EXPERT_PARAMS = {"experts.gate_up_proj_bias": "b13", "experts.down_proj_bias": "b2",
                  "experts.gate_up_proj": "w13", "experts.down_proj": "w2"}
_EXPERTS = re.compile(r"\.mlp\.(" + "|".join(map(re.escape, _EXPERT_PARAMS)) + r")$")
_MXFP4 = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_"
                    r"(blocks|scales)$")


def _rename(name: str) -> str:
    name = _EXPERTS.sub(lambda m: ".mlp." + _EXPERT_PARAMS[m[1]], with_prefix("model.")(name))
    return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")


def _make_layer(config, i, prefix, max_positions, window):
    moe = GptOssMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                    config.num_experts_per_tok, f"{prefix}.mlp",
                    alpha=getattr(config, "swiglu_alpha", None) or 1.702,
                    limit=getattr(config, "swiglu_limit", None) or 7.0)
    eps = getattr(config, "rms_norm_eps", 1e-5)
    bias = bool(getattr(config, "attention_bias", True))
    return LlamaDecoderLayer(
        config, i, prefix, max_positions, window, qkv_bias=bias, o_bias=bias, mlp=moe,
        attn_sinks=True,
        # transformers' GptOssRMSNorm multiplies its weight in float32, then casts.
        make_norm=lambda: RMSNorm(config.hidden_size, eps, 0.0, cast_before_weight=False))


class GptOssForCausalLM(LlamaForCausalLM):
    family = "GPT-OSS"

    def __init__(self, config, max_positions: int) -> None:
        # Experts load float or MXFP4 (which resolves to no quantization: dequantized at
        # load); a GPTQ / AWQ / fp8 file of this family is not under test.
        refuse_checkpoint_quant("GptOssForCausalLM")
        super().__init__(config, max_positions)

    @staticmethod
    def sliding_window(config) -> list[int | None]:
        return layer_windows(config)

    @staticmethod
    def model_kwargs(config) -> dict:
        eps = getattr(config, "rms_norm_eps", 1e-5)
        return {"make_layer": _make_layer,
                "make_norm": lambda: RMSNorm(config.hidden_size, eps, 0.0,
                                             cast_before_weight=False)}

    def load_weights(self, tensors: Iterable[TensorSlice]) -> None:
        skip = self.skip_tensors + (("lm_head.",) if self.tied(self.config) else ())
        load_into(self, self._mxfp4_experts(tensors), self.stacked_params, skip, rename=_rename)
        missing = [f"{moe.prefix}.experts.{which}" for moe in self._moes()
                   for which in ("gate_up_proj", "down_proj") if which not in moe.loaded]
        if missing:
            raise CheckpointError(f"checkpoint has no weights for {len(missing)} expert "
                                  f"tensors: {', '.join(missing[:8])}"
                                  + (" ..." if len(missing) > 8 else ""))

    def _moes(self) -> list[GptOssMoE]:
        return [layer.mlp for layer in self.model.layers]

    def _mxfp4_experts(self, tensors: Iterable[TensorSlice]) -> Iterator[TensorSlice]:
        """The tensors that are not MXFP4 experts; each pair of blocks and scales is
        dequantized into its layer as soon as both have been seen."""
        pending: dict[tuple[int, str], dict[str, TensorSlice]] = {}
        moes = self._moes()
        for w in tensors:
            m = _MXFP4.match(w.name)
            if m is None:
                yield w
                continue
            i, which = int(m[1]), m[2]
            if i >= len(moes):
                raise CheckpointError(f"checkpoint tensor {w.name!r} names layer {i}, but the "
                                      f"config has {len(moes)}")
            parts = pending.setdefault((i, which), {})
            parts[m[3]] = w
            if len(parts) == 2:
                moes[i].load_mxfp4(which, parts["blocks"], parts["scales"])
                del pending[(i, which)]
        if pending:
            (i, which), parts = next(iter(pending.items()))
            (have,) = parts
            other = "scales" if have == "blocks" else "blocks"
            raise CheckpointError(f"checkpoint tensor {parts[have].name!r} has no "
                                  f"{which}_{other} beside it: MXFP4 experts need both")
