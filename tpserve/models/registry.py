"""Model classes keyed by the `architectures` name in config.json, imported lazily."""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "tpserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tpserve.models.llama:MistralForCausalLM",
    "MixtralForCausalLM": "tpserve.models.mixtral:MixtralForCausalLM",
    "T5ForConditionalGeneration": "tpserve.models.t5:T5ForConditionalGeneration",
    "MT5ForConditionalGeneration": "tpserve.models.t5:MT5ForConditionalGeneration",
    "UMT5ForConditionalGeneration": "tpserve.models.t5:UMT5ForConditionalGeneration",
    "GemmaForCausalLM": "tpserve.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "tpserve.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "tpserve.models.gemma3:Gemma3ForCausalLM",
    "BloomForCausalLM": "tpserve.models.bloom:BloomForCausalLM",
    "Qwen2ForCausalLM": "tpserve.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "tpserve.models.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "tpserve.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "tpserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Phi3ForCausalLM": "tpserve.models.phi3:Phi3ForCausalLM",
    "GraniteForCausalLM": "tpserve.models.granite:GraniteForCausalLM",
    "Starcoder2ForCausalLM": "tpserve.models.starcoder2:Starcoder2ForCausalLM",
    "GPTNeoXForCausalLM": "tpserve.models.gpt_neox:GPTNeoXForCausalLM",
    "PhiForCausalLM": "tpserve.models.phi:PhiForCausalLM",
    "Olmo2ForCausalLM": "tpserve.models.olmo2:Olmo2ForCausalLM",
    "GraniteMoeForCausalLM": "tpserve.models.granite_moe:GraniteMoeForCausalLM",
    "GPTBigCodeForCausalLM": "tpserve.models.gpt_bigcode:GPTBigCodeForCausalLM",
    "CohereForCausalLM": "tpserve.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "tpserve.models.cohere:Cohere2ForCausalLM",
    "GptOssForCausalLM": "tpserve.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "tpserve.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "tpserve.models.deepseek:DeepseekV3ForCausalLM",
    "Llama4ForCausalLM": "tpserve.models.llama4:Llama4ForCausalLM",
    "NemotronForCausalLM": "tpserve.models.nemotron:NemotronForCausalLM",
    "FalconForCausalLM": "tpserve.models.falcon:FalconForCausalLM",
}

# Labels older checkpoints carry for a family served under another name: Falcon's first
# releases (remote code) named it RWForCausalLM, a label later `falcon` configs keep.
_LEGACY = {"RWForCausalLM": "FalconForCausalLM"}


# The family of each model_type (what transformers' Auto classes go by): the architecture
# of a config.json that names none, and the one served over another family's label.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM", "t5": "T5ForConditionalGeneration",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "bloom": "BloomForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "mt5": "MT5ForConditionalGeneration", "umt5": "UMT5ForConditionalGeneration",
    "granite": "GraniteForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "gpt_oss": "GptOssForCausalLM",
    "cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM", "nemotron": "NemotronForCausalLM",
    "falcon": "FalconForCausalLM",
}


def register(architecture: str, target: str) -> None:
    _MODELS[architecture] = target


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(config):
    """The class that serves config. `architectures` must name a model tpserve serves (a
    classification head is refused); the family is then the one of the config's model_type
    where tpserve lists it: transformers' Auto classes build the model of the config class
    and never read `architectures`, so a Qwen2 config labelled LlamaForCausalLM is a Qwen2
    (its q/k/v biases count) and a UMT5 one labelled T5ForConditionalGeneration a UMT5."""
    archs = list(getattr(config, "architectures", None) or [])
    by_type = _BY_MODEL_TYPE.get(getattr(config, "model_type", None))
    if not archs and by_type:
        archs = [by_type]
    for arch in archs:
        arch = arch if arch in _MODELS else _LEGACY.get(arch, arch)
        if arch in _MODELS:
            # Only a built-in family gives way; a class register()ed under its own name is
            # what its checkpoints ask for.
            if by_type and arch != by_type and arch in _BY_MODEL_TYPE.values():
                log.warning("config.json names %s but its model_type %r is %s's: serving it "
                            "as %s, as transformers does", arch, config.model_type, by_type,
                            by_type)
                arch = by_type
            module, _, attr = _MODELS[arch].partition(":")
            return getattr(importlib.import_module(module), attr)
    encoders = [a for a in archs if a.endswith("EncoderModel")]
    if encoders:  # T5EncoderModel, MT5EncoderModel, UMT5EncoderModel
        raise ValueError(
            f"config.json names {encoders[0]}: an encoder alone (it turns text into "
            "embeddings), with no decoder to generate text. Serve a checkpoint of the whole "
            f"model ({encoders[0].removesuffix('EncoderModel')}ForConditionalGeneration, "
            "with decoder weights); tpserve does not serve embeddings")
    from tpserve.hf_config import text_only_architectures

    raise ValueError(
        f"unsupported model architecture {archs or '(config.json names none)'} (model_type "
        f"{getattr(config, 'model_type', None)!r}); tpserve "
        f"supports: {', '.join(supported_architectures())}; and, served as text only (text "
        f"in, text out, no images), the vision-language "
        f"{', '.join(text_only_architectures())}"
    )
