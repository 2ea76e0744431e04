"""Steps captured as graphs in pieces around eager attention (worker/piecewise.py).

On the CPU each piece is an OpGraph (tests/op_graph.py: the aten ops recorded during capture,
run again on the same tensors by replay), so the machinery a CUDA run depends on is checked
here: where the pieces are cut, the staging of q/k/v, the shared output buffer, the bucket a
step replays, the rows past the step's tokens, and greedy tokens against transformers with
prompts arriving while others decode (mixed steps). The real capture runs on CUDA (-m gpu)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import cuda_engine, make_engine
from op_graph import cpu_piece_capture_api
from tiny_models import PROMPTS, hf_greedy

from tpserve.engine.request import SamplingParams
from tpserve.worker import piecewise
from tpserve.worker.piecewise import PiecewiseGraphs, token_buckets


def staggered_greedy(engine, prompts: list[str], n: int, every: int = 3) -> list[list[int]]:
    """Greedy continuations with the prompts admitted one by one, `every` steps apart, so
    later prompts are prefilled in steps where earlier ones decode."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    pending = list(prompts)
    seqs, done, step = [], {}, 0
    while pending or len(done) < len(seqs):
        if pending and step % every == 0:
            seqs.append(engine.add_request(engine.tokenize(pending.pop(0)), params))
        events, _ = engine.step()
        step += 1
        for sid, ev in events:
            if ev.finished:
                done[sid] = next(s for s in seqs if s.seq_id == sid).output_ids
    return [done[s.seq_id] for s in seqs]


def _pieces_on_cpu(engine, monkeypatch, buckets=(16, 32, 64)) -> PiecewiseGraphs:
    monkeypatch.setattr(piecewise, "piece_capture_api", cpu_piece_capture_api)
    worker = engine.executor.worker
    pieces = PiecewiseGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                             buckets, worker.cfg.cache.block_size,
                             scratch_block=worker.num_blocks)
    pieces.capture(worker.dtype)
    worker.pieces = worker.runner.pieces = pieces
    return pieces


def test_token_buckets_follow_the_step_budget():
    assert token_buckets(4096)[-1] == 512
    assert token_buckets(100) == (16, 32, 64, 96)
    assert token_buckets(8) == (16,)


def test_a_mixture_of_experts_is_captured_only_for_small_steps(models_dir):
    """Inside a graph every expert runs on every token: only steps that read every expert
    anyway (up to 64 tokens) are captured for Mixtral."""
    from tiny_models import mixtral_config, save_model

    engine = make_engine(save_model(mixtral_config(), models_dir / "mixtral-pieces"), 1,
                         local=True, num_blocks=64)
    model = engine.executor.worker.model
    assert token_buckets(4096, model) == (16, 32, 64)
    engine.shutdown()


def test_one_piece_per_attention_call_and_one_after(llama_dir, monkeypatch):
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch)
    layers = engine.executor.worker.model.model.layers
    for tokens in pieces.buckets:
        bucket = pieces.captured[tokens]
        assert len(bucket.calls) == len(layers)
        assert len(bucket.graphs) == len(layers) + 1
        assert [c.layer for c in bucket.calls] == [lay.self_attn.attn for lay in layers]
        assert bucket.hidden.shape[0] == tokens
        # Every call's output is the one shared buffer the next piece reads.
        assert len({c.out.data_ptr() for c in bucket.calls}) == 1
        assert all(len(g.ops) > 0 for g in bucket.graphs)
    engine.shutdown()


def test_mixed_steps_in_pieces_match_transformers(llama_dir, monkeypatch):
    """Every step (the first prefill, prefills next to decode rows, decode) replays the
    pieces: 16 tokens and fewer replay bucket 16, longer chunks 32 or 64."""
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch)
    used = {}
    run = pieces.run

    def counting_run(ids, positions, meta):
        tokens = next(b for b in pieces.buckets if b >= ids.shape[0])
        used[tokens] = used.get(tokens, 0) + 1
        return run(ids, positions, meta)

    monkeypatch.setattr(pieces, "run", counting_run)
    got = staggered_greedy(engine, PROMPTS, 12)
    assert got == hf_greedy(llama_dir, PROMPTS, 12)
    assert used.get(16, 0) > 0 and used.get(32, 0) + used.get(64, 0) > 0, used
    engine.shutdown()


def test_a_piece_that_loses_its_attention_output_changes_the_tokens(llama_dir, monkeypatch):
    """The check above can fail: replaying without writing attention's output into the
    buffer the next piece reads gives other tokens."""
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch)
    for bucket in pieces.captured.values():
        for call in bucket.calls:
            call.out = torch.empty_like(call.out)  # the copy lands where no piece reads
    got = staggered_greedy(engine, PROMPTS, 12)
    assert got != hf_greedy(llama_dir, PROMPTS, 12)
    engine.shutdown()


def test_steps_past_the_largest_bucket_run_eagerly(llama_dir, monkeypatch):
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch, buckets=(16,))
    assert pieces.fits(16) and not pieces.fits(17) and not pieces.fits(0)
    long_prompt = " ".join(PROMPTS * 2)
    assert len(engine.tokenize(long_prompt)) > 16
    got = staggered_greedy(engine, [long_prompt, PROMPTS[1]], 8)
    assert got == hf_greedy(llama_dir, [long_prompt, PROMPTS[1]], 8)
    engine.shutdown()


def test_pieces_are_declined_on_the_cpu(llama_dir):
    engine = make_engine(llama_dir, 1, local=True)
    assert engine.executor.worker.health()["piecewise_graphs"] == []
    engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
def test_pieces_captured_on_cuda_match_transformers(llama_dir, overlap):
    engine = cuda_engine(llama_dir, overlap, max_num_batched_tokens=256)
    health = engine.executor.health()[0]
    assert health["piecewise_graphs"] == list(token_buckets(256))
    runner = engine.executor.worker.runner
    calls = []
    run = runner.pieces.run
    runner.pieces.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    assert staggered_greedy(engine, PROMPTS, 24) == hf_greedy(llama_dir, PROMPTS, 24)
    # Each admission of a prompt longer than one token was a step in pieces (a one-token
    # prompt next to decode rows is a decode step: a decode graph takes it).
    longer = sum(len(engine.tokenize(p)) > 1 for p in PROMPTS)
    assert len(calls) >= longer, calls
    assert engine.executor.health()[0]["compiles_since_warmup"] == 0
    engine.shutdown()


def test_cohere2_mixed_steps_in_pieces_match_transformers(models_dir, monkeypatch):
    """Cohere 2's pieces: each attention call staged with its rotary or none (the full
    layer), prompts prefilled beside decode rows."""
    from tiny_models import family_checkpoint

    path = family_checkpoint(models_dir, "cohere2")
    engine = make_engine(path, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch)
    runs, run = [0], pieces.run

    def counting_run(ids, positions, meta):
        runs[0] += 1
        return run(ids, positions, meta)

    monkeypatch.setattr(pieces, "run", counting_run)
    try:
        assert staggered_greedy(engine, PROMPTS, 12) == hf_greedy(path, PROMPTS, 12)
    finally:
        engine.shutdown()
    assert runs[0] > 0
