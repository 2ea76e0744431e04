"""Warmup compiles everything before serving; serving compiles nothing.

On the CPU: the engine warms every batch-size bucket, the compile counter detects a compile
during serving (shown with a backend that compiles on a new batch size), stays at zero for
the torch backend, and the Triton backend's warmup plan covers every bucket and every
compile key a live step can produce. On a CUDA machine (`-m gpu`): the real Triton compile
count, and a second start that compiles nothing thanks to the on-disk cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from engine_utils import greedy

from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tpserve.engine.engine import Engine
from tpserve.executor.inprocess import InProcessExecutor
from tpserve.kernels.base import AttentionSpec
from tpserve.kernels.compile_cache import (
    compile_count,
    configure_triton_cache,
    dynamo_compile_count,
    warmup_batch_sizes,
)
from tpserve.kernels.torch_backend import TorchAttentionBackend
from tpserve.kernels.triton_backend import compile_key, warmup_plan

PROMPTS = ["The quick brown fox", "Hello world", "A paged cache stores keys", "Ray"]


def engine_config(path, max_num_seqs: int = 8, kernel: str = "torch") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(path), model_id=str(path), max_model_len=128),
        parallel=ParallelConfig(tp_size=1, device="cpu", cpus_per_shard=1),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
        kernel=kernel)


class RecordingExecutor(InProcessExecutor):
    def warmup(self, batch_sizes) -> float:
        self.buckets = tuple(batch_sizes)
        return super().warmup(batch_sizes)


class CompilesPerBatchSize(TorchAttentionBackend):
    """Runs a torch.compile'd function specialised on the batch size, so a batch size
    warmup did not see compiles on a live request: what the counter must catch."""

    name = "compiles-per-batch"

    def __init__(self) -> None:
        self._scale = torch.compile(lambda x: x * 1.0, backend="eager", dynamic=False)

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        return self._scale(super().decode(q, k_cache, v_cache, meta, spec, alibi_slopes, **kw))

    def warmup(self, device, dtype, spec, batch_sizes=(1,)):
        for b in batch_sizes:
            self._scale(torch.zeros(b, spec.num_heads, spec.head_dim, dtype=dtype))


def test_batch_buckets():
    assert warmup_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert warmup_batch_sizes(6) == (1, 2, 4, 6)
    assert warmup_batch_sizes(1) == (1,)


def test_engine_warms_every_bucket_and_serving_compiles_nothing(llama_dir):
    cfg = engine_config(llama_dir, max_num_seqs=8)
    executor = RecordingExecutor(cfg)
    engine = Engine(cfg, executor)
    try:
        assert executor.buckets == (1, 2, 4, 8)
        before = dynamo_compile_count()
        greedy(engine, PROMPTS, 8)
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
        assert dynamo_compile_count() == before
    finally:
        engine.shutdown()


def test_a_compile_during_serving_is_counted(llama_dir):
    """The same check fails when a backend compiles for a batch size warmup skipped."""
    engine = Engine(engine_config(llama_dir), InProcessExecutor(engine_config(llama_dir)))
    try:
        worker = engine.executor.worker
        worker.backend = CompilesPerBatchSize()
        worker.warmup((1,))  # too few buckets on purpose
        assert compile_count(worker.backend) > 0  # warmup itself compiled
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
        greedy(engine, PROMPTS, 4)  # decodes 4 sequences at once: batch size 4 is new
        assert engine.executor.health()[0]["compiles_since_warmup"] > 0
        worker.warmup(warmup_batch_sizes(8))
        greedy(engine, PROMPTS, 4)
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
    finally:
        engine.shutdown()


def test_triton_warmup_plan_covers_every_bucket_and_live_key():
    """Needs no triton: the plan and the compile keys are plain Python. A live step's key
    depends on the model only, never on batch size, context length or block-table width."""
    buckets = warmup_batch_sizes(64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kw in ({}, {"sliding_window": 7}, {"alibi": True}, {"softcap": 30.0},
                   {"num_kv_heads": 1}, {"sinks": True, "sliding_window": 128},
                   {"attention_chunk": 8192}, {"head_dim": 192}, {"head_dim": 80}):
            spec = AttentionSpec(**{"num_heads": 8, "num_kv_heads": 2, "head_dim": 128,
                                    "scale": 128**-0.5, "block_size": 16, **kw})
            plan = warmup_plan(dtype, spec, buckets)
            decode_sizes = sorted(len(c.query_lens) for c in plan if c.kind == "decode")
            assert decode_sizes == list(buckets)
            mixed = [c for c in plan if c.kind == "prefill"]
            # A decode row after the prompt, and one before it (the scheduler's order: the
            # leading decode rows go to the decode kernel, the prompt from an offset).
            assert sorted(c.query_lens[0] == 1 for c in mixed) == [False, True]
            assert all(1 in c.query_lens and max(c.query_lens) > 64 for c in mixed)
            keys = {c.key for c in plan}
            assert keys == {compile_key("decode", dtype, spec), compile_key("prefill", dtype, spec)}
    assert compile_key("decode", torch.float16, spec) != compile_key("decode", torch.bfloat16,
                                                                     spec)
    # Sinks and chunks are compile-time flags: a model's layers with and without them
    # (gpt-oss's windows, Llama 4's full-attention layers) are separate warmup keys.
    for kw in ({"sinks": True}, {"attention_chunk": 16}):
        assert compile_key("decode", torch.float16, replace(spec, **kw)) != compile_key(
            "decode", torch.float16, spec)


def test_triton_cache_dir_defaults_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert configure_triton_cache() == tmp_path / "tpserve" / "triton"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "tpserve" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert configure_triton_cache() == tmp_path / "mine"  # the user's choice wins


# --- GPU ----------------------------------------------------------------------------------
START = textwrap.dedent("""
    import json, random, sys, torch
    from tpserve.kernels.base import AttentionMetadata, AttentionSpec
    from tpserve.kernels.compile_cache import warmup_batch_sizes
    from tpserve.kernels.triton_backend import TritonAttentionBackend
    dev, dtype = torch.device("cuda"), torch.bfloat16
    specs = [AttentionSpec(32, 8, 128, 128**-0.5, block_size=16),
             AttentionSpec(16, 16, 64, 0.125, sliding_window=64, alibi=True, softcap=30.0,
                           block_size=16)]
    backend = TritonAttentionBackend()
    for spec in specs:
        backend.warmup(dev, dtype, spec, warmup_batch_sizes(64))
    after_warmup = backend.compile_count()
    rng = random.Random(0)
    for step in range(60):  # live-like steps: any batch size, context, table width, mix
        spec = specs[step % 2]
        b = rng.randint(1, 64)
        q_lens = [1 if rng.random() < 0.7 else rng.randint(2, 300) for _ in range(b)]
        if step % 3 == 0:
            q_lens = [1] * b
        ctx = [q + rng.randint(0, 900) for q in q_lens]
        width = max(-(-c // 16) for c in ctx) + rng.randint(0, 40)
        tables = torch.randint(0, 8000, (b, width), dtype=torch.int32, device=dev)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            torch.tensor(starts, dtype=torch.int32, device=dev),
            torch.tensor(ctx, dtype=torch.int32, device=dev), tables,
            torch.zeros(starts[-1], dtype=torch.long, device=dev), max(q_lens), max(ctx),
            tuple(q_lens), tuple(ctx))
        shape = backend.kv_cache_shape(8000, spec)
        kc = torch.randn(shape, dtype=dtype, device=dev)
        q = torch.randn(starts[-1], spec.num_heads, spec.head_dim, dtype=dtype, device=dev)
        slopes = torch.rand(spec.num_heads, device=dev) if spec.alibi else None
        backend.forward(q, kc, kc, meta, spec, slopes)
    torch.cuda.synchronize()
    print(json.dumps({"warmup": [r.__dict__ for r in backend.reports],
                      "after_warmup": after_warmup, "after_serving": backend.compile_count(),
                      "unplanned": backend.unplanned_launches}, default=str))
""")


@pytest.mark.gpu
def test_triton_cold_then_warm_start_and_no_compile_while_serving(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    print(json.dumps(runs, indent=1))
    for run in runs:
        assert run["after_serving"] == run["after_warmup"] > 0
        assert run["unplanned"] == 0
    assert sum(r["compiled_from_source"] for r in cold["warmup"]) == cold["after_warmup"]
    assert sum(r["compiled_from_source"] for r in warm["warmup"]) == 0
