"""Rotary tables against transformers' own rope initialisation for each scaling type."""

from __future__ import annotations

import pytest
import torch

from tpserve.layers.rotary import inv_frequencies, rope_parameters

CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024,
                      rope_scaling=CASES[name], rope_theta=50000.0)
    params = rope_parameters(cfg)
    ours, scale = inv_frequencies(64, params)
    kind = params["rope_type"]
    if kind == "default":
        ref = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope_type 'made-up' is not supported"):
        inv_frequencies(64, {"rope_type": "made-up", "rope_theta": 1e4})


@pytest.mark.parametrize(("scaling", "full"), [
    (None, {"rope_type": "default", "rope_theta": 1000000}),
    ({"rope_type": "linear", "factor": 8.0},
     {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000}),
])
def test_gemma3_hub_configs_give_each_layer_type_its_rope(scaling, full):
    """Gemma 3's config.json as published (rope_theta for the global layers,
    rope_local_base_freq for the windowed ones, rope_scaling on the global ones only in the
    4B+ models), as transformers resolves it: one rope setting per layer type."""
    from transformers import CONFIG_MAPPING

    from tpserve.layers.rotary import layer_rope_parameters

    cfg = CONFIG_MAPPING["gemma3_text"].from_dict({
        "model_type": "gemma3_text", "hidden_size": 1152, "head_dim": 256,
        "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 26,
        "intermediate_size": 6912, "query_pre_attn_scalar": 256, "rope_theta": 1000000,
        "rope_local_base_freq": 10000, "rope_scaling": scaling, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144, "max_position_embeddings": 32768})
    got = layer_rope_parameters(cfg)
    assert got == {"full_attention": {**full, "max_position_embeddings": 32768},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000,
                                         "max_position_embeddings": 32768}}
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_one_rope_for_every_layer_where_the_config_has_one():
    from tiny_models import qwen3_config

    from tpserve.layers.rotary import layer_rope_parameters

    assert layer_rope_parameters(qwen3_config()) is None
