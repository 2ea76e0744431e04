"""Checkpoints whose rotary scaling the fixtures do not use, served against transformers
(float32, CPU). Dynamic NTK scaling (rope_scaling type "dynamic", as some long-context
Llama 2 fine-tunes ship) keeps transformers' default frequencies while a sequence stays
within max_position_embeddings and rescales them past it, step by step, which a paged KV
cache cannot follow: tpserve serves such a checkpoint up to that length, exactly, and
refuses a longer --max-total-tokens at start."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine
from tiny_models import PROMPTS, hf_greedy, llama_config, save_model

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.worker.build import check_shardable

POSITIONS = 64
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


@pytest.fixture(scope="module")
def dynamic_dir(models_dir):
    # Old-style keys, as a config.json written by transformers 4.x has them.
    return save_model(llama_config(rope_scaling={"type": "dynamic", "factor": 4.0},
                                   max_position_embeddings=POSITIONS),
                      models_dir / "llama-rope-dynamic")


def test_dynamic_ntk_inverse_frequencies_match_transformers_within_the_context():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tpserve.layers.rotary import inv_frequencies, rope_parameters

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024,
                      rope_scaling=DYNAMIC, rope_theta=50000.0)
    ours, scale = inv_frequencies(64, rope_parameters(cfg))
    ref, ref_scale = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == ref_scale


def test_dynamic_ntk_llama_matches_transformers(dynamic_dir):
    """Prompts (the longest 52 tokens) and continuations within the 64 positions: the
    same greedy tokens."""
    engine = make_engine(dynamic_dir, 1, local=True, max_model_len=POSITIONS)
    try:
        assert greedy(engine, PROMPTS, 12) == hf_greedy(dynamic_dir, PROMPTS, 12)
    finally:
        engine.shutdown()


def test_dynamic_ntk_past_the_context_is_refused_at_start(dynamic_dir):
    from tpserve.weights import load_hf_config

    cfg = EngineConfig(model=ModelConfig(path=str(dynamic_dir), model_id="t",
                                         max_model_len=POSITIONS + 1),
                       parallel=ParallelConfig(tp_size=2))
    with pytest.raises(ValueError) as err:
        check_shardable(cfg, load_hf_config(dynamic_dir))
    msg = str(err.value)
    for needle in ("dynamic", f"{POSITIONS} positions", "max_position_embeddings",
                   f"--max-total-tokens {POSITIONS}", f"{POSITIONS + 1}"):
        assert needle in msg, msg


@pytest.mark.parametrize("config", ["llama", "mistral", "gemma"])
def test_a_partial_rotary_factor_transformers_leaves_unread_rotates_whole_heads(models_dir,
                                                                                config):
    """transformers' Llama, Mistral and Gemma rotate whole heads whatever
    partial_rotary_factor config.json carries (only Phi, Phi-3, Nemotron and GPT-NeoX read
    it); tpserve rotated the first half of each head (prefill logits 1.5x the logits' size
    off)."""
    import tiny_models
    from engine_utils import prefill_logits
    from tiny_models import hf_last_logits

    from tpserve.layers.rotary import partial_rotary_factor

    cfg = getattr(tiny_models, f"{config}_config")(partial_rotary_factor=0.5)
    assert partial_rotary_factor(cfg) == 0.5  # guards the fixture: the config carries it
    path = save_model(cfg, models_dir / f"{config}-partial-rotary", std=0.3, vector_std=0.1)
    ref, ref_logits = hf_greedy(path, PROMPTS, 12), hf_last_logits(path, PROMPTS)
    engine = make_engine(path, 1, local=True)
    try:
        for got, want in zip(prefill_logits(engine, PROMPTS), ref_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
        assert greedy(engine, PROMPTS, 12) == ref
    finally:
        engine.shutdown()
