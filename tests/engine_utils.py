"""Helpers to run the real engine (Ray shard actors) on a checkpoint in tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tpserve.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.engine import Engine
from tpserve.engine.request import SamplingParams


def make_engine(path: Path, tp: int, *, block_size: int = 4, num_blocks: int = 256,
                max_model_len: int = 256, max_batch_tokens: int = 512, kernel: str = "auto",
                local: bool = False, forked: bool = False, cpus_per_shard: int = 1,
                prefix_caching: bool = False, quantize: str = "auto",
                async_scheduling: bool = True, kv_cache_dtype: str = "auto",
                lora: LoraConfig | None = None,
                speculative: SpeculativeConfig | None = None,
                max_num_seqs: int | None = None) -> Engine:
    """max_num_seqs: the scheduler's (its default when None); fewer sequences warm up fewer
    decode batch sizes, which counts under Triton's interpreter. local: tp = 1 in this
    process; forked: shards forked by a fork server (forked_shards.py), not Ray actors."""
    seqs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    cfg = EngineConfig(
        model=ModelConfig(path=str(path), model_id=str(path), max_model_len=max_model_len,
                          quantize=quantize),
        parallel=ParallelConfig(tp_size=tp, device="cpu", cpus_per_shard=cpus_per_shard),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_batch_tokens,
                                  async_scheduling=async_scheduling, **seqs),
        kernel=kernel, lora=lora or LoraConfig(),
        speculative=speculative or SpeculativeConfig())
    if forked:
        from forked_shards import ForkedShards

        from tpserve.executor.factory import shard_config

        return Engine(cfg, ForkedShards(shard_config(cfg)))
    from tpserve.executor.factory import build_executor

    return Engine(cfg, build_executor(cfg, in_process=local))


@contextmanager
def served_engine(path: Path, model_id: str, *, max_model_len: int,
                  max_concurrent_requests: int, server: ServerConfig | None = None,
                  **engine: object) -> Iterator[tuple[AsyncEngine, str]]:
    """The real app over an in-process tp = 1 engine on `path`, served on a free local port;
    yields (backend, base URL), stops the engine on exit. `server`: the app's settings
    (default: ServerConfig()); `engine`: more make_engine arguments (block_size, ...)."""
    from fake_backend import serve

    from tpserve.server.app import build_app

    backend = AsyncEngine(lambda: make_engine(path, 1, local=True, max_model_len=max_model_len,
                                              **engine),
                          model_id, max_concurrent_requests=max_concurrent_requests)
    backend.start()
    try:
        backend.wait_ready(180)
        with serve(build_app(backend, server)) as url:
            yield backend, url
    finally:
        backend.stop()



def chat_choice(client, stream: bool, **kw: object):
    """The first choice of a chat completion through the `openai` client: whole, or
    streamed and put together by the client's own stream helper."""
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        return s.get_final_completion().choices[0]


def cuda_engine(path: Path, overlap: bool, lora: LoraConfig | None = None,
                kernel: str = "triton", **scheduler) -> Engine:
    """A tiny model's in-process engine on CUDA with the Triton kernels (captured graphs),
    or the backend `kernel` names ("auto": what a launch on CUDA picks)."""
    from tpserve.executor.inprocess import InProcessExecutor

    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="t", max_model_len=256),
                       parallel=ParallelConfig(device="cuda"),
                       cache=CacheConfig(block_size=16, num_blocks=128), kernel=kernel,
                       scheduler=SchedulerConfig(async_scheduling=overlap, **scheduler),
                       lora=lora or LoraConfig())
    return Engine(cfg, InProcessExecutor(cfg))


def assert_cuda_greedy_matches(path: Path, prompts: list[str], n: int, kernel: str = "triton",
                               graphs: bool = True) -> None:
    """`path` served on CUDA (cuda_engine, overlapped steps) gives transformers' n greedy
    tokens (CPU, float32), with decode graphs captured as `graphs` says and nothing
    compiled after warmup."""
    from tiny_models import hf_greedy

    engine = cuda_engine(path, True, kernel=kernel)
    try:
        health = engine.executor.health()[0]
        assert bool(health["decode_graphs"]) == graphs, health
        assert greedy(engine, prompts, n) == hf_greedy(path, prompts, n)
        health = engine.executor.health()[0]
        assert health["compiles_since_warmup"] == 0, health
    finally:
        engine.shutdown()


def greedy(engine: Engine, prompts: list[str], n: int) -> list[list[int]]:
    return greedy_ids(engine, [engine.tokenize(p) for p in prompts], n)


def greedy_ids(engine: Engine, prompts: list[list[int]], n: int | list[int]
               ) -> list[list[int]]:
    """Greedy continuations of token-id prompts run as one batch; n new tokens each (or
    n[i] for prompt i)."""
    news = n if isinstance(n, list) else [n] * len(prompts)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=k, ignore_eos=True))
            for p, k in zip(prompts, news, strict=True)]
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


def assert_matches_reference(engine: Engine, prompts: list[str], ref_tokens: list[list[int]],
                             ref_logits: list[torch.Tensor], rel: float = 1e-4) -> None:
    """Prefill logits within rel of the reference, then greedy tokens identical."""
    for got, ref in zip(prefill_logits(engine, prompts), ref_logits, strict=True):
        assert got.shape == ref.shape
        assert_close_rel(got, ref, rel)
    assert greedy(engine, prompts, len(ref_tokens[0])) == ref_tokens


def engine_matches_reference(path: Path, tp: int, ref_tokens: list[list[int]],
                             ref_logits: list[torch.Tensor], rel: float = 1e-4,
                             ray: bool = False) -> None:
    """A tp-rank engine over path serves PROMPTS as the reference does (assert_matches_
    reference), then shuts down whatever the outcome. tp = 1 runs in this process and tp > 1
    on shards forked by a fork server (forked_shards.py): the same Worker, model code and gloo
    collectives a Ray actor runs, without a Ray actor's start (~4 s of CPU each: Python,
    Ray, torch), which made up most of each case. ray: on Ray actors (a replica's own path;
    test_tp_llama.py runs Llama's matrix so)."""
    from tiny_models import PROMPTS

    engine = make_engine(path, tp, local=tp == 1 and not ray, forked=tp > 1 and not ray)
    try:
        assert_matches_reference(engine, PROMPTS, ref_tokens, ref_logits, rel)
    finally:
        engine.shutdown()


def load_rank(path: Path, rank: int, tp: int):
    """One rank's model loaded on the CPU without a process group (loading needs none);
    returns (model, LoadStats) so tests can see what the rank read."""
    from tpserve.distributed import tp_context
    from tpserve.weights import LoadStats, iter_checkpoint, load_hf_config
    from tpserve.worker.build import build_model

    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="t", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    stats = LoadStats()
    with tp_context(rank, tp):
        model = build_model(cfg, load_hf_config(path), torch.device("cpu"))
        model.load_weights(iter_checkpoint(path, stats, show_progress=False))
    return model, stats


def assert_ipex_declines_and_triton_takes(spec, plain, reason: str) -> None:
    """auto passes IPEX over for `spec` naming `reason`, an explicit --kernel ipex is refused
    with it, and Triton answers for spec as for `plain` (the same spec without the feature):
    it declines on this machine for the device only, never for the feature."""
    from tpserve.errors import KernelUnavailableError
    from tpserve.kernels.registry import select_backend
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    cpu = torch.device("cpu")
    _, passed_over = select_backend("auto", cpu, torch.float32, [spec])
    assert passed_over["ipex"] == reason
    with pytest.raises(KernelUnavailableError) as err:
        select_backend("ipex", cpu, torch.float32, [spec])
    assert f"attention backend 'ipex' cannot run here: {reason}" == str(err.value)
    assert (TritonAttentionBackend.supports(cpu, torch.float32, spec)
            == TritonAttentionBackend.supports(cpu, torch.float32, plain))


def assert_varied(ref_tokens: list[list[int]]) -> None:
    """Guards an oracle: continuations that repeat one token, or prompts that all continue
    alike, would make a match with them easy."""
    assert all(len(set(t)) > 3 for t in ref_tokens)
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)


def assert_unlike_reference(path: Path, ref_tokens: list[list[int]],
                            ref_logits: list[torch.Tensor], margin: float = 0.5) -> None:
    """Oracle guard: an in-process engine over path (loaded some plausible wrong way by the
    caller) gives PROMPTS' logits more than margin away from the reference's, and other
    greedy tokens, so a match with the reference (1e-4 relative) tells the two apart."""
    from tiny_models import PROMPTS

    engine = make_engine(path, 1, local=True)
    try:
        got = prefill_logits(engine, PROMPTS)
        tokens = greedy(engine, PROMPTS, len(ref_tokens[0]))
    finally:
        engine.shutdown()
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref_logits, strict=True))
    assert diff > margin
    assert tokens != ref_tokens
