"""An out-of-tree attention backend, pip-installed like a user would, is listed by
`tpserve kernels` and serves tp = 1 (in-process) and tp = 2 (Ray shard actors) with the same
greedy tokens as transformers, through its own KV-cache layout."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import greedy, make_engine
from tiny_models import PROMPTS, hf_greedy

PLUGIN_SRC = Path(__file__).parent / "data" / "plugin_pkg"
DIST = "tpserve-example-kernel"


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)


def _builds_offline() -> bool:
    """setuptools >= 70.1 builds wheels by itself; older ones need `wheel` beside them."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory):
    """Install the plugin into this environment (not a private path: Ray shard actors
    started later must find its entry point too) and remove it afterwards. Built from a
    copy so no build/ or egg-info lands in the source tree."""
    src = tmp_path_factory.mktemp("plugin") / "plugin_pkg"
    shutil.copytree(PLUGIN_SRC, src)
    args = ["install", "--no-deps", "--quiet", str(src)]
    if _builds_offline():
        args.insert(2, "--no-build-isolation")
    proc = _pip(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    importlib.invalidate_caches()
    try:
        yield
    finally:
        _pip("uninstall", "-y", "--quiet", DIST)
        sys.modules.pop("tpserve_example_kernel", None)
        importlib.invalidate_caches()


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, 16)


def test_kernels_command_lists_the_plugin(example_plugin):
    proc = subprocess.run([sys.executable, "-m", "tpserve.cli", "kernels", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("  example (plugin tpserve_example_kernel:ExampleBackend)")
    rest = lines[at + 1 :]
    end = next((i for i, ln in enumerate(rest) if not ln.startswith("    ")), len(rest))
    block = "\n".join(rest[:end])
    assert "supports: prefill+decode, sliding_window, alibi, softcap" in block
    assert "KV cache layout: [num_blocks, kv_heads, block_size, head_dim]" in block


def test_tp1_serves_through_the_plugin(example_plugin, llama_dir, reference):
    engine = make_engine(llama_dir, 1, kernel="example", local=True)
    try:
        worker = engine.executor.worker
        assert type(worker.backend).__module__ == "tpserve_example_kernel"
        k_cache = worker.kv_caches[0][0]
        # The plugin's layout, not the default: [blocks, kv_heads, block_size, head_dim].
        # The engine's blocks plus the scratch block that padded decode-graph rows write to.
        assert tuple(k_cache.shape) == (engine.num_blocks + 1, 2, 4, 16)
        assert greedy(engine, PROMPTS, 16) == reference
        assert worker.backend.steps > 0
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
    finally:
        engine.shutdown()


def test_tp2_serves_through_the_plugin(example_plugin, ray_cluster, llama_dir, reference):
    engine = make_engine(llama_dir, 2, kernel="example")
    try:
        assert [r.backend for r in engine.load_reports] == ["example", "example"]
        assert greedy(engine, PROMPTS, 16) == reference
        health = engine.executor.health()
        assert [h["backend"] for h in health] == ["example", "example"]
        assert all(h["compiles_since_warmup"] == 0 for h in health)
    finally:
        engine.shutdown()
