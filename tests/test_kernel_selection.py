"""Choosing an attention backend: --kernel auto says what it picked and why it passed over
the others; an explicit choice that cannot run here fails at start-up with the reason, in
the engine and on the command line; `tpserve kernels` lists what each backend supports."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from engine_utils import make_engine

from tpserve.cli import main
from tpserve.errors import KernelUnavailableError
from tpserve.kernels.base import AttentionSpec
from tpserve.kernels.registry import select_backend, why_not

CPU = torch.device("cpu")
SPEC = AttentionSpec(4, 2, 16, 0.25, block_size=4)


def triton_reason() -> str:
    return why_not("triton", CPU, torch.float32, SPEC) or ""


def test_explicit_triton_on_cpu_is_refused_with_the_reason():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 lets triton run on the CPU")
    reason = triton_reason()
    assert reason in ("triton is not installed", "no CUDA or XPU device (this worker runs on cpu)")
    with pytest.raises(KernelUnavailableError, match="attention backend 'triton' cannot run here"
                       ) as err:
        select_backend("triton", CPU, torch.float32, [SPEC])
    assert reason in str(err.value)


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KernelUnavailableError, match="unknown attention backend 'nope'.*torch"):
        select_backend("nope", CPU, torch.float32, [SPEC])


def test_auto_picks_torch_here_and_says_why_not_the_others():
    backend, passed_over = select_backend("auto", CPU, torch.float32, [SPEC])
    if why_not("ipex", CPU, torch.float32, SPEC) is None:
        pytest.skip("IPEX is installed here: auto picks it")
    assert backend.name == "torch"
    assert set(passed_over) == {"ipex", "triton"}
    assert "intel_extension_for_pytorch" in passed_over["ipex"]
    assert passed_over["triton"] == triton_reason()


def test_new_spec_features_are_declined_not_miscomputed():
    """Backends written before a spec field existed refuse specs that use it."""
    names = {f.name for f in dataclasses.fields(AttentionSpec)}
    if "causal" not in names:
        pytest.skip("AttentionSpec has no causal flag yet")
    from tpserve.kernels.capabilities import unknown_feature_reason

    assert unknown_feature_reason(SPEC) is None
    cross = dataclasses.replace(SPEC, causal=False)
    assert "non_causal" in unknown_feature_reason(cross)
    assert why_not("torch", CPU, torch.float32, cross) is None  # the reference has it


def test_engine_start_fails_with_the_reason(llama_dir):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 lets triton run on the CPU")
    with pytest.raises(KernelUnavailableError, match=re.escape(triton_reason())):
        make_engine(llama_dir, 1, kernel="triton", local=True)


def test_engine_logs_the_choice_and_the_passed_over(llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="tpserve.engine.core")
    engine = make_engine(llama_dir, 1, kernel="auto", local=True)
    try:
        assert engine.load_reports[0].backend == engine.executor.worker.backend.name
    finally:
        engine.shutdown()
    line = next(r.getMessage() for r in caplog.records if "attention backend" in r.getMessage())
    chosen = engine.load_reports[0].backend
    assert f"attention backend {chosen}" in line
    for name, reason in engine.load_reports[0].passed_over.items():
        assert f"passed over {name}: {reason}" in line
    if chosen == "torch":
        assert "passed over triton" in line and "passed over ipex" in line


def test_kernels_command_lists_backends_and_features(capsys):
    assert main(["kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention backends on cpu (float32); --kernel auto picks: ")
    blocks = _blocks(out)
    assert {"ipex", "triton", "torch"} <= set(blocks)
    assert "supports: prefill+decode, sliding_window, alibi, softcap" in blocks["torch"]
    assert "KV cache layout: [num_blocks, block_size, kv_heads, head_dim]" in blocks["torch"]
    assert "dense, fp8_kv_cache, sinks, chunked" in blocks["torch"]
    if triton_reason():
        assert f"unavailable: {triton_reason()}" in blocks["triton"]


def _blocks(out: str) -> dict[str, str]:
    """`tpserve kernels` output split per backend: {name: its indented lines}."""
    blocks: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("    "):
            blocks[line.split()[0]] = []
        else:
            list(blocks.values())[-1].append(line.strip())
    return {k: "\n".join(v) for k, v in blocks.items()}


@pytest.mark.slow  # a whole launch through Ray (~20 s on two cores)
def test_launch_exits_nonzero_with_the_reason():
    """The whole start-up path: Ray, the driver actor, a shard actor refusing the kernel."""
    if triton_reason() == "" or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton can run here")
    proc = subprocess.run(
        [sys.executable, "-m", "tpserve.cli", "launch", "--kernel", "triton", "--device", "cpu",
         "--port", "0", "--no-dashboard"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert proc.returncode != 0
    assert f"start-up failed: attention backend 'triton' cannot run here: {triton_reason()}" \
        in proc.stdout + proc.stderr


def test_an_fp8_cache_goes_only_to_backends_that_declare_one(monkeypatch):
    """auto passes IPEX over with the reason naming the backends that have an fp8 cache; a
    backend whose supports() would accept anything is still refused by the registry unless
    it sets fp8_kv_cache = True."""
    from dataclasses import replace

    from tpserve.errors import KernelUnavailableError
    from tpserve.kernels import registry
    from tpserve.kernels.base import AttentionBackend

    fp8 = replace(SPEC, kv_cache_dtype="fp8")
    backend, passed_over = select_backend("auto", CPU, torch.float32, [fp8])
    assert backend.name == "torch"
    assert passed_over["ipex"].startswith("the ipex backend has no fp8 KV cache (--kv-cache-"
                                          "dtype fp8 runs on the torch and triton backends")
    with pytest.raises(KernelUnavailableError, match="'ipex' cannot run here: the ipex "
                                                     "backend has no fp8 KV cache"):
        select_backend("ipex", CPU, torch.float32, [fp8])

    class AcceptsAnything(AttentionBackend):
        name = "old-plugin"

        @classmethod
        def supports(cls, device, dtype, spec):
            return None

        def prefill(self, *a, **k): ...

        def decode(self, *a, **k): ...

    monkeypatch.setattr(registry, "load_backend_class", lambda name: AcceptsAnything)
    assert registry.why_not("old-plugin", CPU, torch.float32, SPEC) is None
    assert "old-plugin backend has no fp8 KV cache" in registry.why_not(
        "old-plugin", CPU, torch.float32, fp8)
