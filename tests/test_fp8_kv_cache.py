"""--kv-cache-dtype fp8 served end to end on the CPU (tiny random Llama, tp = 1 in-process and
tp = 2 over Ray) against transformers in float32, plus the cache sizing and the start-up
errors. The kernels themselves are held to the reference in tests/kernels/.

The oracle is transformers run on the engine's own continuation (prompt + generated tokens,
one forward), so every step is compared on the same prefix:
- the engine's log-probability of each token it generated is within LOGPROB_TOL of
  transformers' for that token;
- its greedy token is transformers' arg-max wherever transformers' top-1 / top-2 margin
  exceeds 2 * LOGPROB_TOL: an engine whose log-probabilities are each within LOGPROB_TOL
  can only prefer another token where the margin is at most twice that. The first step
  where the tokens differ (necessarily such a near tie) ends the comparison of that prompt.

LOGPROB_TOL = 0.15 nats. Each stored key and value is off by at most 2^-4 of itself (e4m3's 3
mantissa bits); the kernel suite bounds one attention output's error by 2^-2 of its largest
value (tests/kernels/conformance.py, worst measured 0.11). In this model (2 layers, hidden
64) that reaches the final log-probabilities as at most 0.06 nats over 4 prompts x 32 steps
(measured at tp 1 and 2; the full-precision cache is within 1e-5), so 0.15 leaves a 2.5x
margin, while a cache read with the wrong scale, the wrong bytes or no dequantization moves
them further (test_the_oracle_fails_a_cache_read_without_its_scale). The error grows with
the model's activations: the same Llama with weights of std 0.25 instead of 0.08 measured
0.85 nats, so this tolerance belongs to this checkpoint, not to fp8 caches in general.
This random model's next-token distributions are flat: at tp 1, 15 of the 91 compared
steps have a margin above 2 * LOGPROB_TOL (the greedy check), all 91 the log-prob check.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine
from tiny_models import PROMPTS

from tpserve.engine.request import SamplingParams

LOGPROB_TOL = 0.15
N_NEW = 32


def engine_greedy(engine, prompts, n):
    """[(prompt ids, generated ids, their log-probabilities)] of a greedy run."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
    done: set[int] = set()
    while len(done) < len(seqs):
        events, _ = engine.step()
        done |= {sid for sid, ev in events if ev.finished}
    return [(list(s.prompt_ids), list(s.output_ids), list(s.output_logprobs)) for s in seqs]


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def compare_with_transformers(hf_model, runs) -> dict:
    """Check every run as the module docstring says; returns what was compared."""
    stats = {"steps": 0, "max_dlp": 0.0, "decisive": 0, "diverged": 0}
    for prompt, out, lps in runs:
        assert len(out) == len(lps) == N_NEW
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0].double()
        ref = logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + N_NEW]
        top = ref.topk(2)
        for i, tok in enumerate(out):
            dlp = abs(lps[i] - ref[i, tok].item())
            assert dlp <= LOGPROB_TOL, (f"step {i}: logprob {lps[i]:.4f} vs transformers "
                                        f"{ref[i, tok].item():.4f}")
            stats["steps"] += 1
            stats["max_dlp"] = max(stats["max_dlp"], dlp)
            margin = (top.values[i, 0] - top.values[i, 1]).item()
            if margin > 2 * LOGPROB_TOL:
                stats["decisive"] += 1
            if tok != top.indices[i, 0].item():
                assert margin <= 2 * LOGPROB_TOL, (f"step {i}: greedy token {tok} is not "
                                                   f"transformers' {top.indices[i, 0].item()} "
                                                   f"though its margin is {margin:.3f}")
                stats["diverged"] += 1
                break  # the first divergence ends this prompt's comparison
    return stats


def check_fp8_run(hf_model, runs) -> None:
    stats = compare_with_transformers(hf_model, runs)
    # The comparison had teeth: most steps compared, many of them decisive ones...
    assert stats["steps"] >= len(runs) * N_NEW // 2, stats
    assert stats["decisive"] >= 10, stats
    # ...and the cache really was fp8 (the full-precision path is within 1e-5 of transformers).
    assert stats["max_dlp"] > 1e-3, stats


def test_fp8_cache_tp1_matches_transformers_within_tolerance(llama_dir, hf_model):
    engine = make_engine(llama_dir, 1, local=True, kv_cache_dtype="fp8")
    try:
        caches = engine.executor.worker.kv_caches
        assert all(k.dtype == torch.float8_e4m3fn and v.dtype == torch.float8_e4m3fn
                   for k, v in caches)
        runs = engine_greedy(engine, PROMPTS, N_NEW)
    finally:
        engine.shutdown()
    check_fp8_run(hf_model, runs)


def test_fp8_cache_tp2_matches_transformers_within_tolerance(llama_dir, hf_model):
    engine = make_engine(llama_dir, 2, kv_cache_dtype="fp8", forked=True)
    try:
        assert engine.load_reports[0].cache_dtype == "float8_e4m3fn"
        runs = engine_greedy(engine, PROMPTS, N_NEW)
    finally:
        engine.shutdown()
    check_fp8_run(hf_model, runs)


def test_the_oracle_fails_a_cache_read_without_its_scale(llama_dir, hf_model, monkeypatch):
    """Guards the comparison itself: the same fp8 engine reading V at twice its value must
    fail it."""
    from tpserve.kernels import kv_quant

    real = kv_quant.dequantize
    monkeypatch.setattr(kv_quant, "dequantize", lambda x, s, d: real(x, s, d) * 2)
    engine = make_engine(llama_dir, 1, local=True, kv_cache_dtype="fp8")
    try:
        runs = engine_greedy(engine, PROMPTS, N_NEW)
    finally:
        engine.shutdown()
    with pytest.raises(AssertionError):
        compare_with_transformers(hf_model, runs)


def _loaded_worker(llama_dir, kv: str, dtype: str = "float32"):
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from tpserve.worker.worker import Worker

    cfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="t", dtype=dtype,
                                         max_model_len=64),
                       parallel=ParallelConfig(tp_size=1, device="cpu"),
                       cache=CacheConfig(block_size=4, kv_cache_memory_gb=2e-4,
                                         kv_cache_dtype=kv))
    worker = Worker(cfg, 0)
    worker.init_distributed("127.0.0.1", 0)
    return worker, worker.load_weights()


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_fp8_cache_sizes_blocks_by_its_own_bytes(llama_dir, dtype, ratio):
    """Bytes per block from the cache dtype: a 1-byte cache gets 4x the blocks of a float32
    one and 2x those of a bfloat16 one in the same memory; the report names the dtype."""
    got = {}
    for kv in ("auto", "fp8"):
        worker, report = _loaded_worker(llama_dir, kv, dtype)
        try:
            worker.allocate_cache(2)
            got[kv] = (report.cache_bytes_per_block, worker.available_blocks(),
                       report.cache_dtype, worker.kv_caches[0][0].dtype)
        finally:
            worker.shutdown()
    assert got["auto"][2] == dtype and got["fp8"][2] == "float8_e4m3fn"
    assert got["fp8"][3] == torch.float8_e4m3fn
    assert got["auto"][0] == ratio * got["fp8"][0]
    assert got["fp8"][1] // ratio == got["auto"][1]


def test_fp8_cache_reaches_every_paged_spec_and_only_fp8_backends(llama_dir):
    worker, report = _loaded_worker(llama_dir, "fp8")
    try:
        assert report.backend == "torch"
        assert "no fp8 KV cache" in report.passed_over["ipex"]
        assert all(m.spec.kv_cache_dtype == "fp8" for m in worker._attention_layers())  # noqa: SLF001
    finally:
        worker.shutdown()


def test_fp8_on_a_device_that_cannot_store_it_fails_at_start(llama_dir, monkeypatch):
    from tpserve.kernels import kv_quant

    monkeypatch.setattr(kv_quant, "fp8_unavailable", lambda device: "no float8 here")
    with pytest.raises(RuntimeError, match="--kv-cache-dtype fp8 cannot run on cpu: no float8"):
        _loaded_worker(llama_dir, "fp8")
    from tpserve.distributed import reset_tp

    reset_tp()


def test_fp8_unavailable_checks_the_real_device():
    from tpserve.kernels import kv_quant

    assert kv_quant.fp8_unavailable(torch.device("cpu")) is None


def test_t5_fp8_cache_quantizes_self_and_cross_attention(models_dir):
    """Encoder-decoder: the decoder's self- and cross-attention caches are fp8 (one block
    pool), the encoder's dense attention has no cache and keeps its spec; served on the
    torch backend. Accuracy: this tiny random T5 (weights of std 0.5, unscaled scores)
    follows transformers' greedy tokens for the first 2 to 11 steps only, so only the first
    token is compared; see docs/kernels.md."""
    from tiny_models import hf_greedy, save_t5_model, t5_config

    from tpserve.layers.encoder_decoder import DenseAttention, PagedCrossAttention

    path = save_t5_model(t5_config(flan=True), models_dir / "t5-fp8")
    ref = hf_greedy(path, PROMPTS, 2)
    engine = make_engine(path, 1, local=True, kv_cache_dtype="fp8")
    try:
        worker = engine.executor.worker
        layers = worker._attention_layers()  # noqa: SLF001
        assert any(isinstance(m, PagedCrossAttention) for m in layers)
        for m in layers:
            want = "auto" if isinstance(m, DenseAttention) else "fp8"
            assert m.spec.kv_cache_dtype == want, m
        assert all(k.dtype == torch.float8_e4m3fn for k, _ in worker.kv_caches)
        runs = engine_greedy(engine, PROMPTS, 2)
    finally:
        engine.shutdown()
    assert [out[0] for _, out, _ in runs] == [r[0] for r in ref]


def test_triton_warmup_plans_the_fp8_variants():
    """The fp8 kernels are other compile keys; warmup's plan holds them, so serving an fp8
    cache compiles nothing after warmup (checked on the GPU below)."""
    from dataclasses import replace

    from tpserve.kernels.base import AttentionSpec
    from tpserve.kernels.triton_backend import compile_key, warmup_plan

    spec = AttentionSpec(8, 2, 128, 128**-0.5, block_size=16)
    fp8 = replace(spec, kv_cache_dtype="fp8")
    for kind in ("decode", "prefill"):
        assert compile_key(kind, torch.bfloat16, fp8) != compile_key(kind, torch.bfloat16, spec)
    keys = {c.key for c in warmup_plan(torch.bfloat16, fp8, (1, 8))}
    assert keys == {compile_key("decode", torch.bfloat16, fp8),
                    compile_key("prefill", torch.bfloat16, fp8)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fp8_cache_on_cuda_with_triton_and_graphs(llama_dir, hf_model):
    """The Triton kernels (fused rotary + fp8 write, paged prefill, split-K decode inside
    the captured decode graphs) over an fp8 cache: the same oracle as on the CPU, and no
    kernel compiled after warmup."""
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from tpserve.engine.engine import Engine
    from tpserve.executor.inprocess import InProcessExecutor

    cfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="t", max_model_len=256),
                       parallel=ParallelConfig(device="cuda"),
                       cache=CacheConfig(block_size=16, num_blocks=128, kv_cache_dtype="fp8"),
                       kernel="triton")
    engine = Engine(cfg, InProcessExecutor(cfg))
    try:
        health = engine.executor.health()[0]
        assert health["backend"] == "triton" and health["decode_graphs"]
        assert engine.executor.worker.kv_caches[0][0].dtype == torch.float8_e4m3fn
        runs = engine_greedy(engine, PROMPTS, N_NEW)
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
    finally:
        engine.shutdown()
    stats = compare_with_transformers(hf_model, runs)
    print(stats)
    assert stats["max_dlp"] > 1e-3 and stats["steps"] >= len(runs) * N_NEW // 2, stats
