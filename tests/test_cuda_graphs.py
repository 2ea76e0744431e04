"""Decode graphs: the static-buffer path (padding rows to the scratch block, slots, block
tables) checked on the CPU by replaying each bucket eagerly, and the real capture on CUDA."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_cuda_greedy_matches, cuda_engine, greedy, make_engine
from tiny_models import PROMPTS, hf_greedy

from tpserve.worker.graphs import DecodeGraphs, graphs_supported


class EagerReplay:
    """Stands in for a CUDA graph: replay() recomputes the bucket from the static buffers."""

    def __init__(self, graphs: DecodeGraphs, bucket: int, out: torch.Tensor) -> None:
        self.graphs, self.bucket, self.out = graphs, bucket, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.graphs._forward(self.bucket))


def test_static_buffer_decode_path_matches_transformers(llama_dir):
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64)
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                          (1, 2, 8), max_blocks=64, block_size=4,
                          scratch_block=worker.num_blocks)
    for b in graphs.buckets:
        out = graphs._forward(b)
        graphs.graphs[b] = (EagerReplay(graphs, b, out), out)
    worker.graphs = worker.runner.graphs = graphs  # the model runner replays them
    # 4 sequences: bucket 8 with 4 padded rows writing only to the scratch block.
    assert greedy(engine, PROMPTS, 24) == hf_greedy(llama_dir, PROMPTS, 24)
    # One sequence: bucket 1.
    assert greedy(engine, PROMPTS[:1], 24) == hf_greedy(llama_dir, PROMPTS[:1], 24)
    assert worker.steps > 0
    assert graphs.graphs[8][0].replays > 0 and graphs.graphs[1][0].replays > 0


def test_static_buffer_decode_path_serves_longrope_past_the_original_context(models_dir):
    """A longrope model's decode rows of long sequences read the rotary table's long half
    through the positions buffer, which every replay refills (a graph input, not a value
    captured once): a prompt past the original context (32) and one that crosses it while
    decoding (recomputed eagerly, then decoded long) continue as transformers does."""
    import random

    from engine_utils import greedy_ids
    from tiny_models import hf_greedy_ids, phi3_longrope_config, save_model

    path = save_model(phi3_longrope_config(32), models_dir / "phi3-longrope-graphs")
    prompts = [random.Random(f"graphs-{n}").choices(range(3, 301), k=n) for n in (10, 45)]
    engine = make_engine(path, 1, local=True, num_blocks=64)
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                          (1, 2), max_blocks=64, block_size=4, scratch_block=worker.num_blocks)
    assert graphs.long_rope_offset == 32
    for b in graphs.buckets:
        out = graphs._forward(b)
        graphs.graphs[b] = (EagerReplay(graphs, b, out), out)
    worker.graphs = worker.runner.graphs = graphs
    try:
        assert greedy_ids(engine, prompts, 30) == hf_greedy_ids(path, prompts, [30, 30],
                                                                use_cache=False)
    finally:
        engine.shutdown()
    assert graphs.graphs[2][0].replays > 0


def test_graph_buckets_are_finer_than_powers_of_two():
    from tpserve.worker.graphs import graph_buckets

    assert graph_buckets(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192,
                                  224, 256)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(512)[-3:] == (384, 448, 512)
    # 129 sequences replay the 160 bucket, not 256.
    assert min(b for b in graph_buckets(256) if b >= 129) == 160


def test_graphs_are_declined_with_a_reason_on_cpu(llama_dir):
    engine = make_engine(llama_dir, 1, local=True)
    worker = engine.executor.worker
    assert "CUDA only" in graphs_supported(worker.device, worker.backend, False)
    assert worker.health()["decode_graphs"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
def test_captured_graphs_match_transformers_on_cuda(llama_dir, overlap):
    engine = cuda_engine(llama_dir, overlap)
    assert engine.executor.health()[0]["decode_graphs"]
    assert greedy(engine, PROMPTS, 32) == hf_greedy(llama_dir, PROMPTS, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
def test_captured_graphs_serve_longrope_past_the_original_context_on_cuda(models_dir,
                                                                          overlap):
    """Captured decode graphs and the compiled Triton kernels on a longrope model: a prompt
    past the original context (32) and one that crosses it while decoding."""
    import random

    from engine_utils import greedy_ids
    from tiny_models import hf_greedy_ids, phi3_longrope_config, save_model

    path = save_model(phi3_longrope_config(32), models_dir / "phi3-longrope-cuda")
    prompts = [random.Random(f"graphs-{n}").choices(range(3, 301), k=n) for n in (10, 45)]
    engine = cuda_engine(path, overlap)
    try:
        assert engine.executor.health()[0]["decode_graphs"]
        assert greedy_ids(engine, prompts, 30) == hf_greedy_ids(path, prompts, [30, 30],
                                                                use_cache=False)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_captured_graphs_serve_the_experts_on_cuda(models_dir, name):
    """Inside captured decode graphs every expert runs on every token with zero weights
    (layers/moe.py), Qwen2-MoE's shared expert among them; prefill runs them routed."""
    from tiny_models import family_checkpoint

    path = family_checkpoint(models_dir, name)
    engine = cuda_engine(path, True)
    try:
        assert engine.executor.health()[0]["decode_graphs"]
        assert greedy(engine, PROMPTS, 32) == hf_greedy(path, PROMPTS, 32)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_static_buffer_decode_path_serves_cohere(models_dir, name):
    """Cohere's parallel layer (one all-reduce), per-head q/k norms and logit scale, and
    Cohere 2's rows through layers with and without rotary, through the decode graphs'
    static buffers (replayed eagerly): transformers' tokens, past the window of 8."""
    from tiny_models import family_checkpoint

    path = family_checkpoint(models_dir, name)
    engine = make_engine(path, 1, local=True, num_blocks=64)
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                          (1, 2, 8), max_blocks=64, block_size=4,
                          scratch_block=worker.num_blocks)
    for b in graphs.buckets:
        out = graphs._forward(b)
        graphs.graphs[b] = (EagerReplay(graphs, b, out), out)
    worker.graphs = worker.runner.graphs = graphs
    try:
        assert greedy(engine, PROMPTS, 24) == hf_greedy(path, PROMPTS, 24)
    finally:
        engine.shutdown()
    assert graphs.graphs[8][0].replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_captured_graphs_serve_cohere_on_cuda(models_dir, name):
    """The Triton kernels and captured decode graphs on Cohere's reordered q/k rows and
    Cohere 2's layers without rotary."""
    from tiny_models import family_checkpoint

    path = family_checkpoint(models_dir, name)
    engine = cuda_engine(path, True)
    try:
        assert engine.executor.health()[0]["decode_graphs"]
        assert greedy(engine, PROMPTS, 32) == hf_greedy(path, PROMPTS, 32)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["gpt-oss", "llama4", "deepseek-v3"])
def test_captured_graphs_serve_sinks_chunks_and_padded_heads_on_cuda(models_dir, name):
    """The Triton kernels' sinks (GPT-OSS), chunks of 8 (Llama 4) and 24-wide heads padded
    to 32 (DeepSeek-V3) inside captured decode graphs, nothing compiled after warmup. Run
    under the CPU interpreter only so far (tests/kernels/test_conformance.py)."""
    from tiny_models import family_checkpoint

    assert_cuda_greedy_matches(family_checkpoint(models_dir, name), PROMPTS, 32)
