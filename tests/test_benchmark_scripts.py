"""The benchmark scripts that run without a GPU, run as their docstrings say, at tiny sizes:
each must finish and write its markdown table. They import the engine's internals, so a
change there can break them silently (guided_step and mixed_step once lost an argument
engine_step's set-up had gained; host_step's fake shard report a field the engine had
started to log); the GPU scripts are checked on a GPU when they are run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import llama_config, save_model

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # ~10-30 s each: an engine is built per script


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_model(llama_config(), tmp_path_factory.mktemp("bench") / "llama")


def _run(args: list[str], out: Path | None) -> str:
    """The script's table: what it wrote to `out`, or (None: scripts that write the docs
    only when asked) what it printed."""
    extra = ["--out", str(out)] if out is not None else []
    proc = subprocess.run([sys.executable, "-W", "ignore", *args, *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out.read_text() if out is not None else proc.stdout


SCRIPTS = {
    "engine_step": ["--device", "cpu", "--batches", "1", "2", "--context", "20",
                    "--steps", "3"],
    "guided_step": ["--device", "cpu", "--batches", "1", "2", "--steps", "3"],
    "mixed_step": ["--device", "cpu", "--decode", "2", "--prompt", "8", "--steps", "2"],
    "burst_profile": ["--device", "cpu", "--requests", "4", "--prompt", "16", "--new", "4"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_engine_benchmark_runs_on_the_cpu(script, model, tmp_path):
    text = _run([f"benchmarks/{script}.py", "--model", str(model), *SCRIPTS[script]],
                tmp_path / "out.md")
    assert "| --- |" in text, text


def test_host_step_runs(tmp_path):
    """The host's share of a decode step against a fake executor; --out given, so the
    committed docs/benchmarks.md is not rewritten by the test."""
    text = _run(["benchmarks/host_step.py", "--steps", "2", "--batches", "4",
                 "--prompt-len", "16", "--repeat", "1"], tmp_path / "out.md")
    assert "**total** (median)" in text, text


def test_driver_burst_runs(tmp_path):
    """The real HTTP app and bridge in front of a simulated core: every request answered."""
    text = _run(["benchmarks/driver_burst.py", "--requests", "8", "--prompt", "8", "--new",
                 "4", "--admit", "4", "--prefill-s", "0.002", "--decode-s", "0.002",
                 "--repeat", "1"], tmp_path / "out.md")
    assert "| 32 of 32 |" in text, text  # 8 requests x 4 new tokens, all answered


@pytest.mark.parametrize("args", [
    ["benchmarks/prefix_cache.py", "--requests", "4", "--system-tokens", "32",
     "--new-tokens", "4"],
    ["benchmarks/spec_decode.py", "--requests", "2", "--new-tokens", "8", "--rounds", "1"],
], ids=["prefix_cache", "spec_decode"])
def test_in_process_benchmark_prints_its_table(args):
    """Without --write, so the committed docs stay as they are."""
    assert "| --- |" in _run(args, None)


def test_serve_bench_launches_and_measures_on_the_cpu(tmp_path):
    """Issue 8's served benchmark end to end at toy size: `tpserve launch` in a subprocess
    (its own local Ray cluster, stopped with it), one stream and a burst of 4 requests
    measured and tabled."""
    cfg = tmp_path / "config.json"
    cfg.write_text(llama_config(vocab_size=600).to_json_string())  # the tests' tiny Llama
    text = _run(["benchmarks/serve_bench.py", "--model-config", str(cfg), "--device", "cpu",
                 "--dtype", "float32", "--prompt-len", "16", "--new-tokens", "8",
                 "--concurrency", "4", "--logs", str(tmp_path / "logs")], tmp_path / "out.md")
    assert "| this |" in text, text
