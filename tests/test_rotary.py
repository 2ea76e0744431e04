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
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        inv_frequencies(64, {"rope_type": "longrope", "rope_theta": 1e4})
