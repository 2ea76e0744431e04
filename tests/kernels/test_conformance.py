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
from conformance import CONFIGS, STEP_KINDS, run_conformance

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


def test_triton_kernels_under_the_interpreter():
    """Triton's interpreter runs the real kernels in numpy on the CPU. It reads
    TRITON_INTERPRET when the kernels are defined, hence a fresh process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        # Seen with triton 3.6: the interpreter's int() of 1-element arrays, which numpy 2.4
        # refuses ("only 0-dimensional arrays can be converted to Python scalars").
        pytest.skip(f"triton's interpreter fails with numpy {numpy.__version__}; use numpy<2.4")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conformance import run_conformance
        r = run_conformance("triton", "cpu", torch.float32, head_dims=(16, 64),
                            block_sizes=(4, 16))
        assert not r.declined, r.declined
        print(r.summary())
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores
def test_triton_split_k_decode_under_the_interpreter():
    """Every decode step cut into 3 context splits (flash-decoding) plus the reduction,
    whatever the batch: windows, ALiBi, softcap and GQA/MQA across split boundaries."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
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
    env = dict(os.environ, TRITON_INTERPRET="1", TPSERVE_DECODE_SPLITS="3")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


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
