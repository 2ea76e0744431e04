"""Mistral's sliding window: a window (8 tokens, blocks of 4) much shorter than prompt +
generation matches transformers at tp = 1, 2, 4, and the paged cache of a windowed model
stays bounded (blocks that leave the window go back to the block manager)."""

from __future__ import annotations

import pytest
from engine_utils import assert_close_rel, greedy, make_engine, prefill_logits
from tiny_models import (
    PROMPTS,
    hf_greedy,
    hf_last_logits,
    mistral_config,
    qwen2_config,
    save_model,
)

from tpserve.engine.block_manager import BlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import Sequence

WINDOW, BLOCK = 8, 4
# 21 tokens ("Hello world, this is a tiny model"), plus the shared prompts (13, 7, 52, 1).
WINDOW_PROMPTS = ["Hello world, this is a tiny model", *PROMPTS]
MAX_LIVE = WINDOW // BLOCK + 2


@pytest.fixture(scope="module")
def mistral_dir(models_dir):
    return save_model(mistral_config(sliding_window=WINDOW), models_dir / "mistral-window")


@pytest.fixture(scope="module")
def reference(mistral_dir):
    return hf_greedy(mistral_dir, WINDOW_PROMPTS, 32), hf_last_logits(mistral_dir, WINDOW_PROMPTS)


def test_window_changes_the_oracle(mistral_dir, reference):
    """Guards the oracle: transformers must apply the window (greedy tokens differ from the
    same weights attending to everything), or matching it would prove nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mistral_dir)
    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    model.config.sliding_window = None
    ids = tok(WINDOW_PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)
    assert full[0, ids.shape[1]:].tolist() != reference[0][0]
    assert all(len(set(t)) > 3 for t in reference[0])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mistral_window_matches_transformers(mistral_dir, reference, tp):
    ref_tokens, ref_logits = reference
    engine = make_engine(mistral_dir, tp, block_size=BLOCK, local=tp == 1, forked=tp > 1)
    try:
        assert engine.scheduler.sliding_window == WINDOW
        for got, ref in zip(prefill_logits(engine, WINDOW_PROMPTS), ref_logits, strict=True):
            assert_close_rel(got, ref, 1e-4)
        assert greedy(engine, WINDOW_PROMPTS, 32) == ref_tokens
    finally:
        engine.shutdown()


def test_blocks_stay_while_a_layer_reads_them(models_dir, tmp_path):
    """A Gemma config.json carrying a `sliding_window` key: Gemma's layers (transformers' and
    tpserve's) attend to every key, but the scheduler went by the key and freed the blocks
    outside that window, which the layers then read. It now frees by the windows the model
    built (each rank's load report). The reference decodes without transformers' cache, which
    keeps only `sliding_window` keys whenever the key is set (DynamicCache), unlike the
    model's own forward."""
    import json
    import shutil

    from tiny_models import family_checkpoint

    path = tmp_path / "gemma-window-key"
    shutil.copytree(family_checkpoint(models_dir, "gemma"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": BLOCK}))
    ref = hf_greedy(path, PROMPTS, 16, use_cache=False)
    engine = make_engine(path, 1, block_size=BLOCK, local=True)
    try:
        assert engine.scheduler.sliding_window is None
        assert greedy(engine, PROMPTS, 16) == ref
    finally:
        engine.shutdown()


def _live(seq: Sequence) -> int:
    return sum(b >= 0 for b in seq.block_table)


def test_windowed_cache_stays_bounded_and_matches(mistral_dir):
    """A 6-block cache (24 slots) serves 21 + 64 tokens only because blocks leave the
    window; prompts are chunked (16 tokens a step). The tokens still match transformers."""
    n_new = 64
    ref = hf_greedy(mistral_dir, WINDOW_PROMPTS[:1], n_new)[0]
    engine = make_engine(mistral_dir, 1, block_size=BLOCK, num_blocks=6, max_batch_tokens=16,
                         local=True)
    try:
        blocks = engine.scheduler.blocks
        seq = engine.add_request(engine.tokenize(WINDOW_PROMPTS[0]),
                                 SamplingParams(max_new_tokens=n_new, ignore_eos=True))
        steps = 0
        while not seq.finished:
            engine.step()
            steps += 1
            if not seq.finished:
                assert _live(seq) <= MAX_LIVE, (steps, seq.block_table)
                assert blocks.num_free + _live(seq) == blocks.num_blocks
                assert len(seq.block_table) == -(-seq.num_computed // BLOCK)
        assert seq.output_ids == ref
        assert blocks.num_free == blocks.num_blocks
        assert seq.num_preemptions == 0
    finally:
        engine.shutdown()


def test_qwen2_window_on_some_layers_matches_transformers(models_dir):
    """Qwen2 with use_sliding_window: layers from max_window_layers on slide (here layer 1
    of 2), the others see everything. Each layer gets its own window; no block may leave
    the cache, since layer 0 still reads it. Checked at tp = 1 in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = qwen2_config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    path = save_model(cfg, models_dir / "qwen2-window", vector_std=0.1)
    ref = hf_greedy(path, WINDOW_PROMPTS, 32)
    # Guard: without the window transformers continues differently.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.config.layer_types = ["full_attention"] * 2
    ids = AutoTokenizer.from_pretrained(path)(WINDOW_PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              eos_token_id=None, pad_token_id=2)
    assert full[0, ids.shape[1]:].tolist() != ref[0]
    engine = make_engine(path, 1, block_size=BLOCK, local=True)
    try:
        windows = [layer.self_attn.attn.spec.sliding_window
                   for layer in engine.executor.worker.model.model.layers]
        assert windows == [None, WINDOW]
        assert engine.scheduler.sliding_window is None
        assert greedy(engine, WINDOW_PROMPTS, 32) == ref
    finally:
        engine.shutdown()


def _run(sched: Scheduler, seqs: list[Sequence], check) -> None:
    """Drive the scheduler as the engine does, sampling token 0 after each complete prompt."""
    for s in seqs:
        sched.add(s)
    for _ in range(10_000):
        if not len(sched):
            return
        scheduled = sched.schedule()
        assert scheduled, "the scheduler stalled with work left"
        sampled = [s.seq for s in scheduled if s.completes_prompt]
        sched.after_step(scheduled)
        for seq in sampled:
            seq.output_ids.append(0)
            if len(seq.output_ids) >= seq.params.max_new_tokens:
                sched.finish(seq)
        check()
    raise AssertionError("did not finish")


@pytest.mark.parametrize(("num_blocks", "num_seqs"), [(6, 1), (8, 2), (7, 3)])
def test_scheduler_releases_blocks_outside_the_window(num_blocks, num_seqs):
    """Plain Python (no model): live blocks per running sequence stay <= window / block + 2,
    every block is either free or owned by exactly one sequence, and all come back. With
    too few blocks for every sequence at once, preemption (recompute) still finishes."""
    blocks = BlockManager(num_blocks, BLOCK)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=16, sliding_window=WINDOW)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    seqs = [Sequence(i, list(range(21 + 5 * i)), params) for i in range(num_seqs)]

    def check():
        owned = [b for s in sched.running for b in s.block_table if b >= 0]
        assert len(owned) == len(set(owned))
        assert blocks.num_free + len(owned) == num_blocks
        for s in sched.running:
            assert _live(s) <= MAX_LIVE, s.block_table

    _run(sched, seqs, check)
    assert blocks.num_free == num_blocks
    assert all(len(s.output_ids) == 100 for s in seqs)
    assert sched.can_ever_fit(21 + 100)
