"""Every quantized-matmul kernel against the float64 oracle of quant_conformance.py: the torch
reference on the CPU, Triton's kernels under its interpreter when triton imports (reported as
skipped otherwise, never as passed), plugins found through the entry-point group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from quant_conformance import run_quant_conformance

from tpserve.errors import KernelUnavailableError
from tpserve.kernels.quant import registry
from tpserve.kernels.quant.torch_ref import TorchQuantKernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_on_cpu(dtype):
    result = run_quant_conformance("torch", "cpu", dtype)
    assert result.cases == 240 and not result.failed, result.failed[:3]


def test_triton_kernels_under_the_interpreter():
    """The tile table's GEMV and tensor-core paths, int4 with and without g_idx, and fp8, in
    numpy on the CPU. TRITON_INTERPRET is read when the kernels are defined, hence a fresh
    process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests/kernels")
        from quant_conformance import run_quant_conformance
        for dt in (torch.float32, torch.float16):  # numpy has no bfloat16
            r = run_quant_conformance("triton", "cpu", dt, shapes=((256, 96), (1024, 64)),
                                      groups=(32, 128), batches=(1, 3, 17))
            print(dt, r.cases, len(r.failed), r.worst, r.failed[:3])
            assert r.cases == 42 and not r.failed
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("tile_set", ["prefetch-split", "plain-tails", "split-dense"])
def test_triton_tile_sets_under_the_interpreter(tile_set):
    """Each fixed tile set of quant_conformance.py (prefetching GEMV, split-K spans that run
    past K, factored scales, the dense fallback, tails in N and K) against the oracle."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, "tests/kernels")
        from quant_conformance import run_quant_conformance, triton_with_tiles
        r = run_quant_conformance(triton_with_tiles({tile_set!r}), "cpu", torch.float32,
                                  shapes=((256, 96), (384, 200)), groups=(32, 128),
                                  batches=(1, 3))
        print(r.cases, len(r.failed), r.worst, r.failed[:3])
        assert r.cases == 28 and not r.failed
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def test_one_tile_per_batch_bucket_so_warmup_compiles_every_variant():
    """Within a bucket the tile (and split) depends only on the layer shape: the kernels do
    not specialize on M, so warmup's batch sizes compile all a layer will run."""
    from tpserve.kernels.quant.triton_tiles import BUCKET_MAX, bucket, pick_tile

    for method in ("int4", "fp8"):
        for n, k in ((6144, 4096), (4096, 14336), (200, 384)):
            lo = 1
            for b, hi in enumerate(BUCKET_MAX):
                ms = range(lo, min(hi, 300) + 1)
                assert {bucket(m) for m in ms} == {b}
                assert len({pick_tile(method, m, n, k, 132) for m in ms}) == 1
                lo = hi + 1


def test_tiles_shrink_to_the_shared_memory_of_the_device():
    """Float32 activations double a tile's shared memory: the 64 x 64 x 128 three-stage tile
    asked an H200 for 237,568 bytes (limit 232,448) and must drop a stage; smaller GPUs
    (~99 KB) shrink further; 16-bit tiles that fit stay as chosen."""
    from tpserve.kernels.quant.triton_kernel import fit_shared_memory
    from tpserve.kernels.quant.triton_tiles import Tile

    t = Tile(64, 64, 128, 4, 3)
    assert fit_shared_memory(t, 4, 237568) == t
    assert fit_shared_memory(t, 4, 232448) == Tile(64, 64, 128, 4, 2)
    assert fit_shared_memory(t, 2, 232448) == t
    small = fit_shared_memory(Tile(128, 128, 64, 8, 3), 4, 99 * 1024)
    assert small.stages == 1 and small.block_k == 32


def test_set_tiles_takes_a_sweeps_json_and_refuses_a_short_table():
    from tpserve.kernels.quant import triton_tiles as tt

    saved = {m: list(r) for m, r in tt.TILES.items()}
    try:
        table = tt.tiles_from_json(tt.tiles_to_json(saved))
        assert table == saved
        table["int4"][0] = (tt.Tile(0, 32, 256, prefetch=True), 4)
        tt.set_tiles(table)
        assert tt.pick_tile("int4", 1, 4096, 4096, 132).block_n == 32
        with pytest.raises(ValueError, match="one .tile, programs per SM. per bucket"):
            tt.set_tiles({"fp8": table["fp8"][:2]})
    finally:
        tt.set_tiles(saved)


def test_auto_picks_the_reference_on_cpu_and_says_why_not_triton():
    registry.select_quant_kernel.cache_clear()
    kernel = registry.select_quant_kernel("auto", torch.device("cpu"), torch.float32, "int4")
    assert kernel.name == "torch"
    reason = registry.why_not("triton", torch.device("cpu"), torch.float32, "int4")
    assert reason and ("CUDA and XPU" in reason or "not importable" in reason)


class _PluginKernel(TorchQuantKernel):
    name = "example-int4"


class _EntryPoint:
    name, value = "example-int4", "example:Kernel"

    def load(self):
        return _PluginKernel


def test_plugins_plug_in_by_name_through_the_entry_point_group(monkeypatch):
    from dataclasses import astuple

    from tpserve.kernels.lazy_classes import LazyClasses

    class WithPlugin(LazyClasses):
        def plugins(self) -> dict[str, object]:
            return {"example-int4": _EntryPoint()}

    monkeypatch.setattr(registry, "_CLASSES", WithPlugin(*astuple(registry._CLASSES)))
    registry.select_quant_kernel.cache_clear()
    try:
        assert "example-int4" in registry.available_names()
        kernel = registry.select_quant_kernel("example-int4", torch.device("cpu"),
                                              torch.float32, "int4")
        assert isinstance(kernel, _PluginKernel)
        # auto never picks a plugin: they are opt-in, as for attention.
        assert registry.select_quant_kernel("auto", torch.device("cpu"), torch.float32,
                                            "int4").name == "torch"
        with pytest.raises(KernelUnavailableError, match="known: triton, torch, example-int4"):
            registry.load_kernel_class("nope")
    finally:
        registry.select_quant_kernel.cache_clear()


def test_tpserve_kernels_lists_the_quantized_kernels(capsys):
    from tpserve.cli import main

    assert main(["kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "  torch: supports int4, fp8" in out
    assert "  triton: unavailable" in out
