"""Helpers to run the real engine (Ray shard actors) on a checkpoint in tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.cluster.engine import Engine
from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tpserve.engine.request import SamplingParams


def make_engine(path: Path, tp: int, *, block_size: int = 4, num_blocks: int = 256,
                max_model_len: int = 256, max_batch_tokens: int = 512, kernel: str = "auto",
                local: bool = False, cpus_per_shard: int = 1) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(path=str(path), model_id=str(path), max_model_len=max_model_len),
        parallel=ParallelConfig(tp_size=tp, device="cpu", cpus_per_shard=cpus_per_shard),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_batch_tokens),
        kernel=kernel)
    executor = None
    if local:
        from tpserve.cluster.engine import LocalExecutor

        executor = LocalExecutor(cfg)
    return Engine(cfg, executor)


def greedy(engine: Engine, prompts: list[str], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
    done: dict[int, list[int]] = {}
    while len(done) < len(seqs):
        events, _ = engine.step()
        for sid, ev in events:
            if ev.finished:
                done[sid] = [s for s in seqs if s.seq_id == sid][0].output_ids
    return [done[s.seq_id] for s in seqs]


def prefill_logits(engine: Engine, prompts: list[str]) -> list[torch.Tensor]:
    """Logits after each whole prompt, from the first step (all prompts fit in one step)."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
    events, out = engine.step(return_logits=True)
    assert len(out.tokens) == len(prompts), "every prompt should finish prefill in one step"
    row = {t.seq_id: i for i, t in enumerate(out.tokens)}
    return [torch.tensor(out.logits[row[s.seq_id]]) for s in seqs]


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x max |ref| {scale:.3g}"
