"""Maps checkpoint tensors onto a model's (possibly fused) parameters and loads each rank's
slice through the parameter's weight_loader."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from tpserve.errors import CheckpointError
from tpserve.weights import TensorSlice

log = logging.getLogger(__name__)


def with_prefix(prefix: str, keep: tuple[str, ...] = ("lm_head.",)):
    """A rename for load_into that puts `prefix` ("model.") in front of checkpoint names that
    lack it. A decoder saved from its base model (LlamaModel rather than LlamaForCausalLM, as
    some conversions write it) names its tensors "embed_tokens.weight", "layers.0...",
    "norm.weight"; transformers loads such a file into the causal-LM class by adding its
    base_model_prefix, so tpserve does too instead of refusing it as missing every weight.
    Names starting with `keep` (the head, outside the base model) are left alone."""
    def rename(name: str) -> str:
        return name if name.startswith((prefix, *keep)) else prefix + name
    return rename


# A vision-language checkpoint served as text (hf_config.TEXT_ONLY) names its language
# model's tensors under a prefix of its own: language_model.model.* and
# language_model.lm_head.* as published (Llava, Mistral 3, Gemma 3) or written by
# transformers' save_pretrained, model.language_model.* and lm_head.* in transformers 5's own
# names (save_original_format=False); Qwen2-VL's published names are a decoder's own
# (model.*, lm_head.*). The vision tower, the projector and LLaVA-NeXT's image_newline
# (visual.* for Qwen2-VL), under either prefix, are not read (VISION_TENSORS).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
VISION_TENSORS = ("vision_tower.", "multi_modal_projector.", "image_newline", "visual.")


def text_model_name(name: str) -> str:
    """A vision-language checkpoint's name for a language-model tensor, as the text-only
    model names it ("language_model.model.layers.0..." -> "model.layers.0..."); any other
    name as it is."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def decoder_names(prefix: str = "model."):
    """The rename of a decoder-only family: text_model_name, then with_prefix(prefix)."""
    prefixed = with_prefix(prefix)
    return lambda name: prefixed(text_model_name(name))


def load_into(
    model: nn.Module,
    tensors: Iterable[TensorSlice],
    stacked: list[tuple[str, str, object]] = (),
    skip: tuple[str, ...] = (),
    rename=lambda name: name,
) -> None:
    """stacked: (fused param fragment, checkpoint fragment, shard id), e.g.
    (".qkv_proj", ".q_proj", "q"). skip: substrings of checkpoint names to ignore.
    rename: maps a checkpoint name to the model's parameter name (prefix changes)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # Layers whose method stores checkpoint tensors under other names (LinearMethod).
    renames = {n: m.method.checkpoint_names for n, m in model.named_modules()
               if getattr(getattr(m, "method", None), "checkpoint_names", None)}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for w in tensors:
        if any(s in w.name for s in skip):
            continue
        name, shard_id = rename(w.name), None
        for fused, part, sid in stacked:
            if part in name:
                name, shard_id = name.replace(part, fused), sid
                break
        module, _, tensor = name.rpartition(".")
        if tensor in renames.get(module, {}):
            if renames[module][tensor] is None:
                continue
            name = f"{module}.{renames[module][tensor]}"
        param = params.get(name)
        if param is None:
            unexpected.append(w.name)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise CheckpointError(f"parameter {name} has no weight_loader (a tpserve bug)")
        if shard_id is None:
            loader(param, w)
        else:
            loader(param, w, shard_id)
        loaded.add(name)
    if unexpected:
        log.warning("ignored %d checkpoint tensors with no matching parameter: %s",
                    len(unexpected), ", ".join(unexpected[:8]))
    # Tied parameters appear under several names; one load covers them all.
    by_id: dict[int, list[str]] = {}
    for n, p in params.items():
        by_id.setdefault(id(p), []).append(n)
    # Optional parameters (a GPTQ g_idx without act-order, a scale computed at load) may be
    # absent from the checkpoint.
    missing = [names[0] for names in by_id.values()
               if not loaded.intersection(names) and not getattr(params[names[0]], "optional", False)]
    if missing:
        raise CheckpointError(
            f"checkpoint has no weights for {len(missing)} parameters: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
