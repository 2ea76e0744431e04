"""Phi-3 longrope (Phi-3-*-128k, Phi-3.5, Phi-4-mini) past original_max_position_embeddings,
against transformers' generate (float32, CPU). transformers rotates a sequence of at most
`original` tokens with the short factors and a longer one with the long factors, every
token of it: a longer prompt from the start, and a sequence that grows past `original`
has its KV cache dropped and recomputed (Phi3ForCausalLM.prepare_inputs_for_generation).
tpserve recomputes such a sequence through its preemption path and reads the long half of
the rotary table for it. The tiny model: original 32, max_position_embeddings 256."""

from __future__ import annotations

import random

import pytest
import torch
from engine_utils import greedy_ids, make_engine
from tiny_models import hf_greedy_ids, phi3_longrope_config, save_model

from tpserve.engine.request import SamplingParams
from tpserve.errors import ValidationError

ORIGINAL = 32


def _ids(n: int) -> list[int]:
    """n token ids, none of them bos, eos or pad (0, 1, 2), the same on every run."""
    return random.Random(f"longrope-{n}").choices(range(3, 301), k=n)


# name: (prompt, new tokens)
CASES = {
    "short": (_ids(12), 8),  # 20 tokens: short factors throughout
    "crosses": (_ids(10), 40),  # 22 new tokens short, then recomputed and 18 more long
    "at_the_edge": (_ids(ORIGINAL), 8),  # the prompt fills the original context: 1st decode
    "long": (_ids(45), 16),  # past the original context from its first token
}
NAMES = list(CASES)
PROMPTS = [CASES[k][0] for k in NAMES]
NEWS = [CASES[k][1] for k in NAMES]


@pytest.fixture(scope="module")
def longrope(models_dir):
    """(checkpoint, transformers' tokens per case)."""
    path = save_model(phi3_longrope_config(ORIGINAL), models_dir / "phi3-longrope-32")
    return path, dict(zip(NAMES, hf_greedy_ids(path, PROMPTS, NEWS), strict=True))


def _cached_without_recompute(path, ids: list[int], n: int) -> list[int]:
    """What a cache that keeps its short-factor keys past the crossing would answer:
    transformers' forward step by step on one DynamicCache, never dropped."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache, x, out = DynamicCache(config=model.config), torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=x, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_the_oracle_tells_each_rule_apart(longrope, models_dir):
    """Guards the oracle: its continuations are varied; past the crossing they differ from
    a cache kept across it (so matching them checks the recompute) and from the same
    weights whose long factors equal the short ones (so it checks the long half); before
    the crossing they equal both."""
    path, ref = longrope
    assert all(len(set(t)) > 3 for t in ref.values()), ref
    same = save_model(phi3_longrope_config(ORIGINAL, long=(1.0, 2.0, 4.0, 8.0)),
                      models_dir / "phi3-longrope-32-same")
    no_switch = dict(zip(NAMES, hf_greedy_ids(same, PROMPTS, NEWS), strict=True))
    assert no_switch["short"] == ref["short"]
    for name in ("crosses", "at_the_edge"):
        prompt, n = CASES[name]
        before = ORIGINAL - len(prompt) + 1  # tokens sampled from at most ORIGINAL tokens
        kept = _cached_without_recompute(path, prompt, n)
        assert kept[:before] == ref[name][:before] == no_switch[name][:before]
        assert kept[before:] != ref[name][before:], name
        assert no_switch[name][before:] != ref[name][before:], name
    assert no_switch["long"] != ref["long"]


def test_the_rotary_table_holds_transformers_short_and_long_cos_sin():
    """Rows [0, original) are transformers' cos/sin of a sequence within the original
    context, the rows after them those of a longer one (same attention factor)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from tpserve.layers.rotary import RotaryEmbedding, rope_parameters

    cfg = phi3_longrope_config(ORIGINAL)
    ours = RotaryEmbedding(16, 256, rope_parameters(cfg), 0.5)
    assert ours.long_offset == ORIGINAL and ours.cos.shape == (ORIGINAL + 256, 8)
    ref = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, dtype=torch.float32)
    for length, rows in ((ORIGINAL, slice(0, ORIGINAL)), (256, slice(ORIGINAL, None))):
        cos, sin = ref(x, torch.arange(length)[None])
        torch.testing.assert_close(ours.cos[rows], cos[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.sin[rows], sin[0], rtol=1e-6, atol=1e-6)
    short, long = ref(x, torch.arange(ORIGINAL)[None])[0], ref(x, torch.arange(256)[None])[0]
    assert (short[0, 5:] - long[0, 5:ORIGINAL]).abs().max() > 0.1  # the sets differ


@pytest.mark.parametrize("engine_args", [
    {}, {"async_scheduling": False}, {"max_batch_tokens": 8}, {"prefix_caching": True}],
    ids=["overlapped", "one-at-a-time", "chunked-prefill", "prefix-caching"])
def test_one_batch_matches_transformers(longrope, engine_args):
    """The four cases in one batch (the crossing recomputes one sequence while the others
    decode): each one's tokens equal transformers' run of it alone. Chunks of 8 tokens
    split both the long prompt and the recompute of the crossing sequence."""
    path, ref = longrope
    engine = make_engine(path, 1, local=True, **engine_args)
    try:
        got = greedy_ids(engine, PROMPTS, NEWS)
    finally:
        engine.shutdown()
    assert dict(zip(NAMES, got, strict=True)) == ref


def test_prefix_caching_never_shares_blocks_across_factor_sets(longrope):
    """Requests sharing a 24-token prefix, one after another on one engine: a short one
    (whose prefix blocks are cached with the short factors), a long one (which must not
    reuse them: no hit), one that crosses (its prompt reuses the short blocks, its
    recompute the long ones) and another long one (reusing the long blocks)."""
    path, _ = longrope
    prefix = _ids(24)
    runs = [(prefix + _ids(4), 4), (prefix + _ids(16), 8), (prefix + _ids(5), 12),
            (prefix + _ids(20), 4)]
    want = hf_greedy_ids(path, [p for p, _ in runs], [n for _, n in runs])
    engine = make_engine(path, 1, local=True, prefix_caching=True)
    hits = []
    try:
        for (prompt, n), ref in zip(runs, want, strict=True):
            before = engine.scheduler.blocks.hits
            assert greedy_ids(engine, [prompt], n) == [ref]
            hits.append(engine.scheduler.blocks.hits - before)
    finally:
        engine.shutdown()
    # 6 prefix blocks of 4 tokens; the crossing one reuses them twice (prompt, recompute).
    assert hits == [0, 0, 12, 6], hits


def test_requests_up_to_max_position_embeddings_are_served(longrope):
    """No cap at the original context: the engine's limit is the asked max_model_len."""
    path, _ = longrope
    engine = make_engine(path, 1, local=True, max_model_len=256)
    try:
        assert engine.max_model_len == 256
        engine.validate(_ids(50), SamplingParams(max_new_tokens=206))
        with pytest.raises(ValidationError, match="must be <= 256") as err:
            engine.validate(_ids(50), SamplingParams(max_new_tokens=207))
        assert "longrope" not in str(err.value)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_matches_transformers(longrope, tp):
    """Through Ray shard actors: every rank reads the long half for the same sequences (the
    flag travels in the control message) and recomputes the crossing one."""
    path, ref = longrope
    engine = make_engine(path, tp, local=tp == 1, forked=tp > 1)
    try:
        got = greedy_ids(engine, PROMPTS, NEWS)
    finally:
        engine.shutdown()
    assert dict(zip(NAMES, got, strict=True)) == ref
