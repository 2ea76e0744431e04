"""Every attention backend against the float64 torch reference (tests/kernels/conformance.py).

On the CPU (CI): the torch backend in float32 and bfloat16, the example plugin, IPEX when it
is installed, and Triton's interpreter when triton is installed. On a CUDA machine
(`-m gpu`): torch and triton in float32, bfloat16 and float16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conformance import CONFIGS, FEATURE_CONFIGS, FP8_TOLERANCE, STEP_KINDS, run_conformance

from tpserve.kernels.base import AttentionSpec
from tpserve.kernels.registry import why_not
from tpserve.kernels.torch_backend import TorchAttentionBackend

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SRC = ROOT / "tests" / "data" / "plugin_pkg"
PROBE = AttentionSpec(8, 2, 64, 0.125, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_on_cpu(dtype):
    result = run_conformance("torch", "cpu", dtype)
    assert not result.declined  # the reference supports every configuration
    assert len(result.cases) == len(STEP_KINDS) * len(CONFIGS) * 2 * 2


def test_torch_backend_sinks_and_chunks_on_cpu():
    """FEATURE_CONFIGS (sinks, chunks, both with windows and everything else) against the
    float64 reference: what the Triton runs below are held to."""
    result = run_conformance("torch", "cpu", torch.float32, head_dims=(16,),
                             configs=FEATURE_CONFIGS)
    assert not result.declined
    assert len(result.cases) == len(STEP_KINDS) * len(FEATURE_CONFIGS) * 2


# --- fp8 (e4m3) KV cache ---------------------------------------------------------------
# Scales 1.0 (the default) and 0.3 / 2.5 (as a checkpoint's would be): a kernel that drops
# or swaps the scales fails the second.
FP8_SCALES = [(1.0, 1.0), (0.3, 2.5)]


# bfloat16 with unit scales (~25 s) runs in the slow job: float32's unit scales and
# bfloat16's real ones stay in the default job.
@pytest.mark.parametrize(("dtype", "scales"), [
    pytest.param(dtype, scales, id=f"{name}-{label}",
                 marks=pytest.mark.slow if (name, label) == ("bfloat16", "scale1") else ())
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    for label, scales in zip(("scale1", "scaled"), FP8_SCALES, strict=True)])
def test_torch_backend_fp8_cache_on_cpu(dtype, scales):
    """Every configuration (MHA/GQA/MQA, window, ALiBi, softcap), head_dim 64 and 128,
    prefill, decode and long decode, against the reference reading the same fp8 cache
    (the dtype's tolerance) and against full precision (FP8_TOLERANCE)."""
    result = run_conformance("torch", "cpu", dtype, kv_cache_dtype="fp8", kv_scales=scales)
    assert not result.declined
    assert len(result.cases) == len(STEP_KINDS) * len(CONFIGS) * 2 * 2
    # The quantization is really there: fp8 is measurably off the full-precision output.
    assert 1e-3 < result.worst_fp8_vs_full <= FP8_TOLERANCE


class IgnoresKVScales(TorchAttentionBackend):
    """Reads an fp8 cache as if both scales were 1.0."""

    name = "ignores-scales"

    def forward(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        from dataclasses import replace

        return super().forward(q, k_cache, v_cache, meta, replace(spec, k_scale=1.0,
                                                                  v_scale=1.0),
                               alibi_slopes, **kw)


class WritesE5M2(TorchAttentionBackend):
    """Stores values rounded to e5m2 (2 mantissa bits) instead of e4m3."""

    name = "writes-e5m2"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, spec=None):
        def e5m2(x):
            return x.to(torch.float8_e5m2).to(torch.float32)

        super().write_kv(e5m2(k), e5m2(v), k_cache, v_cache, slot_mapping, spec=spec)


def test_fp8_suite_fails_a_backend_that_ignores_the_scales():
    result = run_conformance(IgnoresKVScales, "cpu", torch.float32, head_dims=(16,),
                             block_sizes=(16,), raise_on_failure=False, kv_cache_dtype="fp8",
                             kv_scales=(0.3, 2.5))
    assert len(result.failures) == len(result.cases)
    ok = run_conformance(IgnoresKVScales, "cpu", torch.float32, head_dims=(16,),
                         block_sizes=(16,), raise_on_failure=False, kv_cache_dtype="fp8")
    assert not ok.failures  # scales of 1.0 cannot tell


def test_fp8_suite_fails_a_backend_that_rounds_differently():
    result = run_conformance(WritesE5M2, "cpu", torch.float32, head_dims=(16,),
                             block_sizes=(16,), raise_on_failure=False, kv_cache_dtype="fp8")
    assert result.failures and all("relative error" in c.detail for c in result.failures)


def test_backends_without_an_fp8_cache_are_declined():
    """The example plugin (written before fp8 caches) and IPEX decline an fp8 spec, saying
    which backends have one; the torch reference accepts it."""
    from dataclasses import replace

    from tpserve.kernels.capabilities import unknown_feature_reason
    from tpserve.kernels.ipex_backend import IpexAttentionBackend

    spec = replace(PROBE, kv_cache_dtype="fp8")
    for reason in (why_not("ipex", torch.device("cpu"), torch.float32, spec),
                   IpexAttentionBackend.supports(torch.device("cpu"), torch.float32, spec),
                   unknown_feature_reason(spec)):
        assert reason and "no fp8 KV cache" in reason and "torch and triton" in reason, reason
    assert why_not("torch", torch.device("cpu"), torch.float32, spec) is None


def test_example_plugin_backend_on_cpu(monkeypatch):
    """The plugin's own cache layout and write_kv, through the same suite (imported from
    its source tree; test_kernel_plugin.py installs it and serves through it)."""
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from tpserve_example_kernel import ExampleBackend

    result = run_conformance(ExampleBackend, "cpu", torch.float32, head_dims=(16, 64))
    assert not result.declined and result.cases


def test_ipex_backend_on_cpu():
    reason = why_not("ipex", torch.device("cpu"), torch.float32, PROBE)
    if reason:
        pytest.skip(f"ipex unavailable here: {reason}")
    for dtype in (torch.float32, torch.bfloat16):
        run_conformance("ipex", "cpu", dtype)


def _need_the_interpreter() -> None:
    """Skip unless Triton's interpreter can run here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        # Seen with triton 3.6: the interpreter's int() of 1-element arrays, which numpy 2.4
        # refuses ("only 0-dimensional arrays can be converted to Python scalars").
        pytest.skip(f"triton's interpreter fails with numpy {numpy.__version__}; use numpy<2.4")


def _interpret(script: str, **env: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh process under TRITON_INTERPRET=1 (Triton reads it when the
    kernels are defined); fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                          env=dict(os.environ, TRITON_INTERPRET="1", **env),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_triton_kernels_under_the_interpreter(kv):
    """Triton's interpreter runs the real kernels in numpy on the CPU. It reads
    TRITON_INTERPRET when the kernels are defined, hence a fresh process. fp8: float32 and
    float16 queries over an e4m3 cache with scales 0.3 / 2.5 (bfloat16 does not run under
    the interpreter). The fp8 grid is the auto one cut in three (float16 at both head dims
    with 16-token blocks, float32 at the small head dim with 4-token blocks): the
    interpreter took 317 s for all of it, and each axis is still crossed once. The auto grid
    likewise: both head dims with 16-token blocks, 4-token blocks at the small one (the wide
    head with small blocks added a minute and crossed nothing new)."""
    _need_the_interpreter()
    grids = ([("float16", (16, 64), (16,)), ("float32", (16,), (4,))] if kv == "fp8"
             else [("float32", (16, 64), (16,)), ("float32", (16,), (4,))])
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import run_conformance
        for dtype, dims, blocks in {grids!r}:
            r = run_conformance("triton", "cpu", getattr(torch, dtype), head_dims=dims,
                                block_sizes=blocks, kv_cache_dtype={kv!r},
                                kv_scales=(0.3, 2.5) if {kv!r} == "fp8" else (1.0, 1.0))
            assert not r.declined, r.declined
            print(r.summary())
    """)
    proc = _interpret(script)
    assert proc.stdout.count(" steps, 0 failed") == 2, proc.stdout


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores
def test_triton_split_k_decode_under_the_interpreter():
    """Every decode step cut into 3 context splits (flash-decoding) plus the reduction,
    whatever the batch: windows, ALiBi, softcap and GQA/MQA across split boundaries; with
    the decode grid in its other order (sequences first)."""
    _need_the_interpreter()
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    spec = AttentionSpec(8, 8, 64, 0.125)
    assert TritonAttentionBackend().num_splits(torch.device("cpu"), 1, spec) > 1
    assert TritonAttentionBackend().num_splits(torch.device("cpu"), 64, spec) == 1
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import run_conformance
        r = run_conformance("triton", "cpu", torch.float32, head_dims=(16,),
                            block_sizes=(16,))
        print(r.summary())
    """)
    # The other decode grid order (sequences first) than the default run above takes.
    proc = _interpret(script, TPSERVE_DECODE_SPLITS="3", TPSERVE_DECODE_HEADS_FIRST="0")
    assert "0 failed" in proc.stdout


@pytest.mark.parametrize("heads, head_dim, taken", [
    (71, 64, True),    # Falcon 7B: 71 query heads on one KV head, a 128 x 64 tile
    (64, 256, True),   # the widest tile of 64 heads
    (71, 128, False),  # past 64 heads, wider than 64 dims
    (129, 64, False),  # taller than 128 rows
])
def test_triton_takes_groups_past_64_in_a_128_by_64_tile(monkeypatch, heads, head_dim, taken):
    """Past 64 query heads per KV head, Triton takes a group only as a 128-row tile of heads
    up to 64 wide (what ran on a GPU); the others go to the torch backend, and the reason
    names the group, its head dims and the limits. Needs triton (the kernels job)."""
    pytest.importorskip("triton", reason="triton is not installed (the kernels job has it)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = AttentionSpec(num_heads=heads, num_kv_heads=1, head_dim=head_dim, scale=0.1)
    reason = why_not("triton", torch.device("cpu"), torch.float32, spec)
    if taken:
        assert reason is None
    else:
        assert reason.startswith(f"{heads} query heads per KV head of {head_dim} dims"), reason
        assert "torch backend" in reason
        assert why_not("torch", torch.device("cpu"), torch.float32, spec) is None


@pytest.mark.slow  # Triton's interpreter
def test_triton_odd_head_groups_under_the_interpreter():
    """Groups of 7 and 5 query heads per KV head (Qwen2.5's sizes; the fixtures and the
    other configurations have groups of 1, 2, 4 and 8) and 71 on one KV head (Falcon 7B:
    past 64: a 128-row tile of heads up to 64 wide), padded to the tiles'
    powers of two, in every kind of step, with a window on a multi-query one."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import ODD_GROUP_CONFIGS, run_conformance
        r = run_conformance("triton", "cpu", torch.float32, head_dims=(16,),
                            block_sizes=(16,), configs=ODD_GROUP_CONFIGS, required=())
        assert not r.declined, r.declined
        print(r.summary())
    """)
    proc = _interpret(script)
    assert " steps, 0 failed" in proc.stdout, proc.stdout


@pytest.mark.slow  # Triton's interpreter: about 15 s on two cores
def test_triton_sinks_and_chunks_under_the_interpreter():
    """gpt-oss's sinks and Llama 4's chunks (FEATURE_CONFIGS: alone, with windows, with
    ALiBi and softcap) in every kind of step: prefill and mixed steps, decode-led steps
    (the decode kernel, then the prefill kernel from an offset), verification rows, decode
    and long decode (split-K: the reduction adds each head's sink once) and decode_new.
    Chunks of 12, 16 and 20 positions against contexts of up to 700: every step crosses
    them. Blocks of 16 only (the chunk bounds are positions; block size 4 runs in the
    torch backend's case above)."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import FEATURE_CONFIGS, run_conformance
        r = run_conformance("triton", "cpu", torch.float32, head_dims=(16,),
                            block_sizes=(16,), configs=FEATURE_CONFIGS)
        assert not r.declined, r.declined
        print(r.summary())
    """)
    proc = _interpret(script)
    assert f"{7 * len(FEATURE_CONFIGS)} steps, 0 failed" in proc.stdout, proc.stdout


@pytest.mark.slow  # Triton's interpreter: about 15 s on two cores
def test_triton_padded_head_dims_under_the_interpreter():
    """Head dims that are not powers of two, padded to one inside the tiles (the cache rows
    stay as wide as the head): Phi's 80 and DeepSeek-V3's 192 with half or all of them
    rotated, and 96 under a window, ALiBi, softcap and GQA at once."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import CONFIGS, run_conformance
        pick = {{c[0]: c for c in CONFIGS}}
        for dims, names in (((80, 192), ["mha"]), ((96,), ["all"])):
            r = run_conformance("triton", "cpu", torch.float32, head_dims=dims,
                                block_sizes=(16,), configs=[pick[n] for n in names])
            assert not r.declined, r.declined
            print(r.summary())
    """)
    proc = _interpret(script)
    assert proc.stdout.count(" steps, 0 failed") == 2, proc.stdout


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores
def test_an_engine_on_the_triton_kernels_matches_transformers_under_the_interpreter():
    """A tiny Llama served in-process by the Triton backend on the CPU (interpreter): its
    decode steps go through the kernel that rotates and stores its own keys (decode_new),
    its prompts through the fused rotary + cache write and the prefill kernel, and the
    greedy tokens equal transformers'."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_utils import greedy, make_engine
        from tiny_models import PROMPTS, hf_greedy, llama_config, save_model
        d = save_model(llama_config(), Path(tempfile.mkdtemp()) / "llama")
        # Four sequences at most (the prompts fit): warmup runs 3 decode batch sizes, not
        # the default scheduler's 7, each slow in the interpreter's numpy.
        engine = make_engine(d, 1, kernel="triton", local=True, max_num_seqs=4)
        got = greedy(engine, PROMPTS, 12)
        backend = engine.executor.worker.backend
        fused = [k for k in backend.launched if "new_kv" in k]
        engine.shutdown()
        assert backend.name == "triton" and fused, (backend.name, backend.launched)
        assert got == hf_greedy(d, PROMPTS, 12), got
        print("tokens match", fused)
    """)
    proc = _interpret(script)
    assert "tokens match" in proc.stdout


@pytest.mark.slow  # Triton's interpreter
def test_a_longrope_engine_on_the_triton_kernels_matches_transformers_under_the_interpreter():
    """Phi-3 longrope (original context 32) on the Triton backend: a prompt past the original
    context and one that crosses it while decoding. The fused kernels take cos/sin rows
    gathered from the rotary table's long half (the positions offset per sequence), so
    decode_new rotates and stores long-factor keys; the greedy tokens equal transformers'."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import random, sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_utils import greedy_ids, make_engine
        from tiny_models import hf_greedy_ids, phi3_longrope_config, save_model
        d = save_model(phi3_longrope_config(32), Path(tempfile.mkdtemp()) / "phi3")
        prompts = [random.Random(f"triton-{{n}}").choices(range(3, 301), k=n) for n in (24, 40)]
        # Four sequences at most (the prompts fit): warmup runs 3 decode batch sizes, not
        # the default scheduler's 7, each slow in the interpreter's numpy.
        engine = make_engine(d, 1, kernel="triton", local=True, max_num_seqs=4)
        got = greedy_ids(engine, prompts, 14)
        backend = engine.executor.worker.backend
        fused = [k for k in backend.launched if "new_kv" in k]
        engine.shutdown()
        assert backend.name == "triton" and fused, (backend.name, backend.launched)
        want = hf_greedy_ids(d, prompts, [14, 14])
        assert got == want, (got, want)
        print("tokens match", fused)
    """)
    proc = _interpret(script)
    assert "tokens match" in proc.stdout


@pytest.mark.slow  # Triton's interpreter: about half a minute on two cores
def test_a_partial_rotary_model_compiles_nothing_after_warmup_under_the_interpreter():
    """The rotary width comes from the model (RotaryEmbedding plans it): warmup launches
    decode_new and the fused rotary at that width, so a model that rotates half of each
    head serves without a launch warmup did not make (the interpreter's compile count is
    the distinct launch keys)."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_utils import greedy, make_engine
        from tiny_models import PROMPTS, phi3_config, save_model
        # Phi-3 reads partial_rotary_factor (Llama leaves it unread, as transformers does):
        # head_dim 16, factor 0.5: 8 rotated dims.
        cfg = phi3_config()
        d = save_model(cfg, Path(tempfile.mkdtemp()) / "phi3")
        # Four sequences at most (the prompts fit): warmup runs 3 decode batch sizes, not
        # the default scheduler's 7, each slow in the interpreter's numpy.
        engine = make_engine(d, 1, kernel="triton", local=True, max_num_seqs=4)
        greedy(engine, PROMPTS, 6)
        backend = engine.executor.worker.backend
        health = engine.executor.health()[0]
        engine.shutdown()
        assert ("new_kv", 8) in {{k[-2:] for k in backend.launched}}, backend.launched
        assert backend.unplanned_launches == 0, backend.launched
        assert health["compiles_since_warmup"] == 0, health
        print("nothing compiled after warmup")
    """)
    assert "nothing compiled after warmup" in _interpret(script).stdout


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores, the three
@pytest.mark.parametrize("family", ["gpt-oss", "llama4", "deepseek-v3"])
def test_sinks_chunks_and_mla_engines_on_the_triton_kernels_match_transformers(family):
    """The families the Triton backend used to decline, served by it on the CPU
    (interpreter): GPT-OSS (sinks on every layer, a window of 8 on two), Llama 4 (chunks of
    8, shorter than every prompt with its continuation, so prefill, mixed and decode steps
    cross them) and DeepSeek-V3 (MLA expanded to 24-wide heads, padded to 32 in the tiles,
    8 rope dims). Warmup covered every launch; the greedy tokens equal transformers'."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_utils import greedy, make_engine
        from tiny_models import FAMILY_CHECKPOINTS, PROMPTS, hf_greedy, save_model
        config, kwargs = FAMILY_CHECKPOINTS[{family!r}]
        d = save_model(config(), Path(tempfile.mkdtemp()) / "m", **kwargs)
        # Four sequences at most: the prompts fit, and warmup runs 3 decode batch sizes.
        engine = make_engine(d, 1, kernel="triton", local=True, max_num_seqs=4)
        got = greedy(engine, PROMPTS, 10)
        backend = engine.executor.worker.backend
        health = engine.executor.health()[0]
        engine.shutdown()
        assert backend.name == "triton", backend.name
        assert any("new_kv" in k for k in backend.launched), backend.launched
        assert backend.unplanned_launches == 0, backend.launched
        assert health["compiles_since_warmup"] == 0, health
        want = hf_greedy(d, PROMPTS, 10)
        assert got == want, (got, want)
        print("tokens match")
    """)
    assert "tokens match" in _interpret(script).stdout


def test_the_decode_rows_split_off_a_mixed_step_are_the_leading_ones():
    """triton_backend.leading_decode_rows: only a prefix of one-token rows goes to the decode
    kernel (the prefill kernel takes the rest from a query_start offset); none without the
    host's query lengths."""
    from tpserve.kernels.triton_backend import leading_decode_rows

    assert leading_decode_rows((1, 1, 1, 256, 1, 7)) == 3
    assert leading_decode_rows((256, 1, 1)) == 0
    assert leading_decode_rows((1, 0, 1)) == 1
    assert leading_decode_rows(()) == 0


# --- the suite itself must catch broken kernels ------------------------------------------
class IgnoresWindow(TorchAttentionBackend):
    name = "ignores-window"

    def forward(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        from dataclasses import replace

        return super().forward(q, k_cache, v_cache, meta, replace(spec, sliding_window=None),
                               alibi_slopes, **kw)


class ReadsPaddingBlocks(TorchAttentionBackend):
    """Attends to whole blocks, including the slots past seq_len (garbage)."""

    name = "reads-padding"

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        from dataclasses import replace

        bs = spec.block_size
        rounded = (meta.seq_lens + bs - 1) // bs * bs
        meta = replace(meta, seq_lens=rounded, max_seq_len=int(rounded.max()))
        return super().decode(q, k_cache, v_cache, meta, spec, alibi_slopes, **kw)


class ForgetsTheNewKeys(TorchAttentionBackend):
    """decode_new attends correctly to a private copy of the cache but never stores the
    step's keys and values in the real one."""

    name = "forgets-new-keys"

    def decode_new(self, q, k, v, rope, k_cache, v_cache, meta, spec, alibi_slopes=None):
        return super().decode_new(q, k, v, rope, k_cache.clone(), v_cache.clone(), meta, spec,
                                  alibi_slopes)


class IgnoresSinks(TorchAttentionBackend):
    """Attends as if there were no sinks (the softmax over the keys alone)."""

    name = "ignores-sinks"

    def forward(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        kw.pop("sinks", None)
        return super().forward(q, k_cache, v_cache, meta, spec, alibi_slopes, **kw)


class IgnoresChunks(TorchAttentionBackend):
    name = "ignores-chunks"

    def forward(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, **kw):
        from dataclasses import replace

        return super().forward(q, k_cache, v_cache, meta, replace(spec, attention_chunk=None),
                               alibi_slopes, **kw)


@pytest.mark.parametrize("backend,feature", [(IgnoresSinks, "sinks"),
                                             (IgnoresChunks, "chunked")])
def test_suite_fails_a_backend_that_ignores_sinks_or_chunks(backend, feature):
    """Every configuration with the feature fails, in every kind of plain step; none
    without it."""
    result = run_conformance(backend, "cpu", torch.float32, head_dims=(16,), block_sizes=(16,),
                             raise_on_failure=False, configs=FEATURE_CONFIGS)
    have = {c[0] for c in FEATURE_CONFIGS if feature in c[0]}
    assert {c.name.split()[0] for c in result.failures} == have
    assert {"mixed", "long decode"} <= {c.step for c in result.failures}


class IgnoresRotaryInDecode(TorchAttentionBackend):
    """decode_new stores and attends without rotating q and the new keys."""

    name = "ignores-rotary"

    def decode_new(self, q, k, v, rope, k_cache, v_cache, meta, spec, alibi_slopes=None):
        return super().decode_new(q, k, v, None, k_cache, v_cache, meta, spec, alibi_slopes)


@pytest.mark.parametrize("backend", [ForgetsTheNewKeys, IgnoresRotaryInDecode])
def test_suite_fails_a_decode_new_that_drops_the_write_or_the_rotary(backend):
    """Only the decode_new steps fail: the rotary-less configurations (ALiBi) still pass a
    backend that ignores the rotary, and the cache check fails the one that forgets."""
    result = run_conformance(backend, "cpu", torch.float32, head_dims=(16,), block_sizes=(16,),
                             raise_on_failure=False)
    assert result.failures
    assert {c.step for c in result.failures} <= {"decode, new kv", "long decode, new kv"}
    if backend is ForgetsTheNewKeys:
        assert all("a decode over the cache it wrote" in c.detail for c in result.failures)
        assert len(result.failures) == 2 * len(CONFIGS)
    else:
        assert not any(c.name.startswith("alibi") for c in result.failures)


def test_suite_fails_a_backend_that_ignores_the_window():
    result = run_conformance(IgnoresWindow, "cpu", torch.float32, head_dims=(16,),
                             raise_on_failure=False)
    failed = {c.name.split()[0] for c in result.failures}
    assert failed == {"window", "all"}


def test_suite_fails_a_backend_that_reads_past_the_context():
    result = run_conformance(ReadsPaddingBlocks, "cpu", torch.float32, head_dims=(16,),
                             block_sizes=(16,), raise_on_failure=False)
    assert result.failures
    with pytest.raises(AssertionError, match="relative error"):
        run_conformance(ReadsPaddingBlocks, "cpu", torch.float32, head_dims=(16,),
                        block_sizes=(16,))


# --- GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backends_on_cuda(backend, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # Block size 4 runs on the CPU (interpreter); 16 here keeps the compile count down.
    result = run_conformance(backend, "cuda", dtype, head_dims=(64, 128, 256),
                             block_sizes=(16,))
    assert not result.declined, result.declined
    print(result.summary())


@pytest.mark.gpu
@pytest.mark.parametrize("scales", FP8_SCALES, ids=["scale1", "scaled"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cache_on_cuda(backend, dtype, scales):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    result = run_conformance(backend, "cuda", dtype, head_dims=(64, 128), block_sizes=(16,),
                             kv_cache_dtype="fp8", kv_scales=scales)
    assert not result.declined, result.declined
    print(result.summary())


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores
def test_a_cohere2_engine_on_the_triton_kernels_matches_transformers_under_the_interpreter():
    """Cohere 2 on the Triton backend: its sliding layers' queries and keys, reordered at
    load, go through the fused rotary + cache write and decode_new's rotate-half rotary
    (serving Cohere's interleaved pairs), its full-attention layer through decode_new with no
    rotary at all, which warmup compiled too; a 52-token prompt runs past the window of 8.
    The greedy tokens equal transformers'."""
    _need_the_interpreter()
    script = textwrap.dedent(f"""
        import sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_utils import greedy, make_engine
        from tiny_models import FAMILY_CHECKPOINTS, PROMPTS, hf_greedy, save_model
        config, kwargs = FAMILY_CHECKPOINTS["cohere2"]
        d = save_model(config(), Path(tempfile.mkdtemp()) / "cohere2", **kwargs)
        # Four sequences at most (the prompts fit): warmup runs 3 decode batch sizes, not
        # the default scheduler's 7, each slow in the interpreter's numpy.
        engine = make_engine(d, 1, kernel="triton", local=True, max_num_seqs=4)
        got = greedy(engine, PROMPTS, 12)
        backend = engine.executor.worker.backend
        health = engine.executor.health()[0]
        engine.shutdown()
        widths = {{k[-1] for k in backend.launched if "new_kv" in k}}
        assert backend.name == "triton" and {{0, 16}} <= widths, backend.launched
        assert backend.unplanned_launches == 0, backend.launched
        assert health["compiles_since_warmup"] == 0, health
        assert got == hf_greedy(d, PROMPTS, 12), got
        print("tokens match", sorted(widths))
    """)
    proc = _interpret(script)
    assert "tokens match" in proc.stdout
