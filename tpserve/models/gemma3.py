"""Gemma 3, text only (Gemma3ForCausalLM, e.g. google/gemma-3-1b-it): Gemma 2's layer with
a (1 + w) RMSNorm over each head's query and key before rotary, a window on most layers
(config.layer_types: five windowed to one global in the released models) whose rotary uses
a base frequency of its own (config.rope_parameters per layer type; LlamaModel keeps one
table per type), and no attention score cap (transformers' Gemma 3 ignores
attn_logit_softcapping; final_logit_softcapping is honoured when set, as there).
The vision-language checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b and up) are
served as text only: their language model, built from the config's text_config
(hf_config.text_only), its tensors named as loader.text_model_name maps them, with the
vision tower left out (LlamaForCausalLM.load_weights)."""

from __future__ import annotations

from tpserve.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, layer_windows


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 sliding_window: int | None) -> None:
        # No score cap: the query/key norms took its place, and transformers' Gemma 3 never
        # passes attn_logit_softcapping to its attention (final_logit_softcapping it applies).
        super().__init__(config, layer, prefix, max_positions, sliding_window, qk_norm=1.0,
                         score_cap=False)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def sliding_window(config) -> list[int | None]:
        return layer_windows(config, getattr(config, "sliding_window_pattern", None) or 6)

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"norm_offset": 1.0, "make_layer": Gemma3DecoderLayer}
