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
    assert result.cases == 312 and not result.failed, result.failed[:3]


def _interpret(code: str) -> None:
    """Run `code` in a fresh process under Triton's interpreter (TRITON_INTERPRET is read when
    the kernels are defined); skipped without triton, never reported as passed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    head = "import sys, torch\nsys.path.insert(0, 'tests/kernels')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


# (dtype, shapes, groups, batches, cases): float32 takes every group size and both int4
# paths' batch sizes; float16 the GEMV and a 16-row tile at odd N and K; bfloat16 the GEMV
# only: the interpreter's tl.dot has no bfloat16 (numpy), the GPU conformance covers it.
TABLE_RUNS = [
    ("float32", ((256, 96), (200, 97)), (32, 64, 128), (1, 5), 52),
    ("float16", ((200, 97),), (64,), (1, 16), 14),
    ("bfloat16", ((200, 97),), (32, 128), (1,), 10),
]


@pytest.mark.parametrize(("dtype", "shapes", "groups", "batches", "cases"), TABLE_RUNS,
                         ids=[r[0] for r in TABLE_RUNS])
def test_triton_table_under_the_interpreter(dtype, shapes, groups, batches, cases):
    """The tile table's paths with weights in the order the kernel asks for (K-contiguous):
    the GEMV, tensor-core tiles, int4 with and without g_idx, symmetric or not, and fp8."""
    _interpret(f"""
        from quant_conformance import run_quant_conformance
        r = run_quant_conformance("triton", "cpu", torch.{dtype}, shapes={shapes!r},
                                  groups={groups!r}, batches={batches!r})
        print(r.cases, len(r.failed), r.worst, r.failed[:3])
        assert r.cases == {cases} and not r.failed
    """)


@pytest.mark.parametrize("tile_set", ["prefetch-split", "plain-tails", "split-dense",
                                      "wide-gemv", "gptq-order", "rows-split",
                                      "rows-pipelined"])
def test_triton_tile_sets_under_the_interpreter(tile_set):
    """Each fixed tile set of quant_conformance.py (prefetching GEMV, split-K spans that run
    past K, factored scales, the dense fallback, tails in N and K, GEMV blocks over several
    groups, the checkpoint's row-major order, its splits summed by the last one to finish, its
    loop pipelined by Triton)
    against the oracle."""
    _interpret(f"""
        from quant_conformance import run_quant_conformance, triton_with_tiles
        r = run_quant_conformance(triton_with_tiles({tile_set!r}), "cpu", torch.float32,
                                  shapes=((200, 97),), groups=(32, 128), batches=(1, 3))
        print(r.cases, len(r.failed), r.worst, r.failed[:3])
        assert r.cases == 20 and not r.failed
    """)


# The one-row fused launches: run_* of quant_conformance and the cases it must count.
FUSED_RUNS = {"gated": ("run_gated_conformance", 16), "fold": ("run_fold_conformance", 32)}


@pytest.mark.parametrize("launch", sorted(FUSED_RUNS))
@pytest.mark.parametrize("tiles", ["table", "rows-split"])
def test_one_row_fused_launches_under_the_interpreter(launch, tiles):
    """The one-row GEMV launches that do more than the matmul, against float64 oracles with
    the separate launches' roundings: "gated", a gated MLP's [gate; up] projection and its
    activation (silu, tanh GELU); "fold", an RMSNorm's x / rms(x) * gamma formed inside the
    GEMV and the residual added as it stores, with and without act-order. With the table's
    tile (no split at these shapes) and three splits finished by the last (rows-split);
    tails in the column blocks (N = 2 x 56). bfloat16 runs the interpreter's float32
    arithmetic (the packed path is PTX: the compile test and the GPU conformance cover it)."""
    run, cases = FUSED_RUNS[launch]
    kernel = "'triton'" if tiles == "table" else f"triton_with_tiles({tiles!r})"
    _interpret(f"""
        from quant_conformance import {run}, triton_with_tiles
        for dt in (torch.float32, torch.bfloat16):
            r = {run}({kernel}, "cpu", dt, shapes=((200, 112), (256, 96)), groups=(32, 128))
            print(dt, r.cases, len(r.failed), r.worst, r.failed[:3])
            assert r.cases == {cases} and not r.failed
    """)


def test_the_oracle_catches_one_wrong_bit_per_word():
    """The conformance check fails a GEMV that misreads the lowest bit of each packed word
    (every eighth weight off by one step)."""
    _interpret("""
        from quant_conformance import run_quant_conformance
        from tpserve.kernels.quant.triton_kernel import TritonQuantKernel

        class OneBitOff(TritonQuantKernel):
            def int4_matmul(self, x, qweight, *args):
                return super().int4_matmul(x, qweight ^ 1, *args)

        r = run_quant_conformance(OneBitOff(), "cpu", torch.float32, shapes=((200, 97),),
                                  groups=(32,), batches=(1,))
        print(r.cases, r.failed[:3])
        assert r.cases == 7 and len(r.failed) == 3
    """)


def test_the_oracle_catches_a_neighbours_block_scale():
    """The fp8 block cases fail kernels that read a neighbouring block's scale (along K, or
    along N), or one scale per row: the GEMV and both tensor-core tile modes (scales on the
    dot's result, scales on the weights), under the interpreter."""
    _interpret("""
        from quant_conformance import FP8_BLOCKS, run_quant_conformance
        from tpserve.kernels.quant.triton_kernel import TritonQuantKernel

        class Misread(TritonQuantKernel):
            def __init__(self, how):
                super().__init__()
                self.how = how

            def fp8_matmul(self, x, weight, scale, block=None):
                if block is not None:
                    scale = {"k": scale.roll(1, 1), "n": scale.roll(1, 0),
                             "row": scale[:, :1].expand_as(scale)}[self.how].contiguous()
                return super().fp8_matmul(x, weight, scale, block)

        for how in ("k", "n", "row"):
            r = run_quant_conformance(Misread(how), "cpu", torch.float32, shapes=((200, 200),),
                                      groups=(), batches=(1, 3))
            print(how, r.cases, r.failed)
            assert r.cases == 8 and len(r.failed) == 6, how
    """)


@pytest.mark.parametrize(("fmt", "kwargs"), [("gptq", dict(sym=False, act_order=True)),
                                           ("awq", {})])
def test_layers_hold_qweight_in_the_kernels_order(models_dir, monkeypatch, fmt, kwargs):
    """A kernel that asks for K-contiguous int4 weights gets them: each rank's slice (tp = 2,
    rank 1: column-parallel output columns, row-parallel input rows) is taken from the
    checkpoint's layout and copied into a qweight whose K // 8 words per column are
    contiguous, holding the same values as the checkpoint-order load, and the layers compute
    the same outputs."""
    from engine_utils import load_rank
    from quant_checkpoints import write_quantized
    from tiny_models import llama_config, save_model

    src = models_dir / "kc-float"
    if not (src / "config.json").exists():
        save_model(llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2), src)
    path, _ = write_quantized(src, models_dir / f"kc-{fmt}", models_dir / f"kc-{fmt}-ref",
                              fmt, group=32, **kwargs)
    registry.select_quant_kernel.cache_clear()
    rows, _ = load_rank(path, 1, 2)
    monkeypatch.setattr(TorchQuantKernel, "int4_k_contiguous", True)
    registry.select_quant_kernel.cache_clear()
    try:
        cols, _ = load_rank(path, 1, 2)
    finally:
        registry.select_quant_kernel.cache_clear()
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        a = rows.get_submodule(f"model.layers.0.{proj}")
        b = cols.get_submodule(f"model.layers.0.{proj}")
        k_words = a.qweight.shape[0]
        assert a.qweight.stride() == (a.qweight.shape[1], 1)
        assert b.qweight.stride() == (1, k_words) and torch.equal(a.qweight, b.qweight)
        x = torch.randn(3, k_words * 8)
        torch.testing.assert_close(b.method.apply(b, x), a.method.apply(a, x), rtol=0, atol=0)


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
