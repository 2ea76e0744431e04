"""A checkpoint's transformers config as plain data, so shards can build the model without
importing transformers.

The launcher reads the config with transformers once (its checks need it before Ray starts);
importing transformers again in every shard process cost 7-11 s of each launch on the H200
host (it pulls in torchvision and much of torch.distributed), on the shard's critical path.
The launcher instead hands the shards what the config object answers: every public attribute
holding plain data, as the object resolved it (family defaults filled in by the config
class's __init__, properties evaluated), and the class's attribute aliases (Bloom's
`num_attention_heads` is `n_head`). Torch-free and transformers-free by design, so the
engine may read the rope settings here too (rope_parameters, longrope_original) without
importing the layers.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any, depth: int = 0) -> tuple[bool, Any]:
    """(True, a JSON-able copy) when value is plain data; a torch dtype becomes its name;
    a nested config (a sub-config object) becomes its to_dict()."""
    if isinstance(value, _PLAIN):
        return True, value
    if depth > 8:
        return False, None
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return True, str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        items = [_plain(v, depth + 1) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            ok, pv = _plain(v, depth + 1)
            if ok and isinstance(k, str):
                out[k] = pv
        return True, out
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return _plain(to_dict(), depth + 1)
        except Exception:  # noqa: BLE001 - not plain after all
            return False, None
    return False, None


# Vision-language checkpoints whose language model tpserve serves on its own (text in, text
# out): architecture -> {the text config's model_type: the text-only architecture serving
# it}. As transformers builds such a model's language model from text_config (AutoModel), the
# text family is the text config's model_type. The weights keep their names
# (language_model.model.*, model.language_model.*); the text model's loader maps them and
# skips the vision tower and projector (models/loader.py text_model_name).
_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}
TEXT_ONLY: dict[str, dict[str, str]] = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM"},
    "LlavaForConditionalGeneration": _LLAVA_TEXT,
    "LlavaNextForConditionalGeneration": _LLAVA_TEXT,
    # Multimodal rotary (rope_parameters.mrope_section) rotates each section of a head by
    # its own position (time, height, width); for text all three are the token's position,
    # so it is Qwen2's 1-D rotary (tests/test_vlm_text_only.py checks it against
    # transformers), and the layers are Qwen2's.
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Llama4ForConditionalGeneration": {"llama4_text": "Llama4ForCausalLM"},
}


def _own(config, name: str, default: Any = None) -> Any:
    """The config's own value of name. transformers 4.5x's Qwen2-VL and Qwen2.5-VL configs
    answer every name their text config also holds from the text config (whose
    architectures is None and whose tie_word_embeddings is its own default)."""
    own = vars(config)
    return own[name] if name in own else getattr(config, name, default)


def text_only(hf_config):
    """The config to build and serve: the config itself, or for a TEXT_ONLY vision-language
    checkpoint its text config, named as the text-only architecture, with the composite
    model's tied-head flag (transformers ties the head by the outer config) and, where the
    text config has none, its dtype and quantization_config. A TEXT_ONLY architecture
    whose language model is of a family tpserve does not serve inside it is refused
    (ValueError naming both)."""
    archs = list(_own(hf_config, "architectures") or [])
    arch = next((a for a in archs if a in TEXT_ONLY), None)
    text = getattr(hf_config, "text_config", None)
    if arch is None or text is None:
        return hf_config
    families = TEXT_ONLY[arch]
    kind = getattr(text, "model_type", None)
    if kind not in families:
        raise ValueError(
            f"{arch} is served as text only when its language model (text_config.model_type) "
            f"is {' or '.join(map(repr, families))}; this checkpoint's is {kind!r}, which "
            "tpserve does not serve inside it (docs/models.md lists what is served)")
    text.architectures = [families[kind]]
    text.tie_word_embeddings = bool(_own(hf_config, "tie_word_embeddings", True))
    if getattr(text, "dtype", None) is None:  # published configs give it on the outer one
        text.dtype = getattr(hf_config, "dtype", None)
    # A quantized checkpoint's quantization_config is the outer config's too.
    quant = _own(hf_config, "quantization_config")
    if quant is not None and getattr(text, "quantization_config", None) is None:
        text.quantization_config = quant
    return text


def text_only_architectures() -> list[str]:
    """The vision-language architectures served as text, each with the language models it
    takes: "LlavaForConditionalGeneration (llama, mistral, qwen2)"."""
    return [f"{arch} ({', '.join(families)})" for arch, families in sorted(TEXT_ONLY.items())]


def snapshot(hf_config) -> str:
    """The config as JSON: {"values": {name: value}, "aliases": {alias: name}}."""
    values: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated properties warn when read
        for name in dir(hf_config):
            if name.startswith("_"):
                continue
            try:
                value = getattr(hf_config, name)
            except Exception:  # noqa: BLE001 - a property that cannot answer: leave it out
                continue
            if callable(value):  # methods, classes
                continue
            ok, plain = _plain(value)
            if ok:
                values[name] = plain
    aliases = dict(getattr(type(hf_config), "attribute_map", None) or {})
    return json.dumps({"values": values, "aliases": aliases})


class ConfigData:
    """Attribute access over a snapshot, as the transformers config object answered it:
    aliases resolve, an unknown name raises AttributeError (so getattr defaults apply)."""

    def __init__(self, text: str) -> None:
        data = json.loads(text)
        self.__dict__["_values"] = data["values"]
        self.__dict__["_aliases"] = data.get("aliases", {})

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        key = self.__dict__["_aliases"].get(name, name)
        if key in values:
            return values[key]
        raise AttributeError(f"the checkpoint's config has no {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a config snapshot is read-only")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__["_values"])

    def __repr__(self) -> str:
        return f"ConfigData({self.__dict__['_values'].get('model_type', '?')})"


def quiet_snapshot(hf_config) -> str:
    """snapshot(), without the deprecation notes that transformers logs for every deprecated
    property the walk reads (`torch_dtype`, `use_return_dict`): they are about the walk, not
    about the user's checkpoint. Only called with a transformers config in hand, so the
    import below costs nothing new."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return snapshot(hf_config)
    finally:
        hf_logging.set_verbosity(level)


def rope_parameters(config) -> dict:
    """The rope settings of a transformers config, old (rope_theta + rope_scaling) or new
    (rope_parameters) style, as one dict with at least rope_type and rope_theta."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    if params["rope_type"] == "longrope":  # Phi-3 keeps it beside rope_scaling
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None))
    return params


def longrope_original(params: dict) -> int | None:
    """The original context of a longrope model (original_max_position_embeddings), past
    which its rotary switches from short_factor to long_factor; None for other rope types.

    transformers' Phi-3 does not switch position by position: a sequence of at most this
    many tokens is rotated with the short factors throughout, a longer one with the long
    factors throughout (a longer prompt from its first token; a sequence that grows past it
    has its KV cache dropped and recomputed, Phi3ForCausalLM.prepare_inputs_for_generation).
    tpserve does the same: the scheduler recomputes a sequence that crosses it (Scheduler,
    Sequence.long_rope) and the worker reads the long half of the rotary table for it."""
    if params.get("rope_type") != "longrope":
        return None
    return int(params["original_max_position_embeddings"])
