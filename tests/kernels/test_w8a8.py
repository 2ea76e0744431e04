"""W8A8 for fp8 checkpoints with a dynamic activation scheme (kernels/quant/w8a8.py): the
per-row e4m3 rounding (torch on the CPU, Triton under its interpreter), the fp8 tensor-core
product on a GPU that has it, and the layers keeping weight-only wherever it cannot run."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from test_quant_kernels import _interpret
from w8a8_conformance import TOL, run_matmul, run_quantize

from tpserve.kernels.quant import w8a8
from tpserve.kernels.quant.torch_ref import TorchQuantKernel
from tpserve.layers.quant.config import QuantConfig
from tpserve.layers.quant.methods import Fp8Method


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_round_to_e4m3_on_cpu(dtype):
    assert run_quantize("cpu", w8a8.quantize_rows_torch, dtype=dtype) == []


def test_the_rounding_check_catches_a_wrong_scale():
    def off(x):
        q, s = w8a8.quantize_rows_torch(x)
        return q, s * 1.05

    assert run_quantize("cpu", off)


def test_triton_rows_under_the_interpreter():
    _interpret("""
        from w8a8_conformance import run_quantize
        from tpserve.kernels.quant import w8a8
        bad = run_quantize("cpu", w8a8.quantize_rows_triton, rows=9, cols=1500)
        assert bad == [], bad
    """)


@pytest.mark.gpu
def test_w8a8_matmul_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    probe = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    reason = w8a8.why_not(probe, probe)
    if reason:
        pytest.skip(reason)
    assert run_quantize("cuda", w8a8.quantize_rows) == []
    rows = run_matmul("cuda")
    assert all(r["error"] <= TOL for r in rows), rows


def _fp8_layer(n: int, k: int):
    g = torch.Generator().manual_seed(2)
    wf = torch.randn(n, k, generator=g)
    scale = (wf.abs().amax(dim=1) / w8a8.FP8_MAX).float()
    return SimpleNamespace(weight=(wf / scale[:, None]).to(torch.float8_e4m3fn),
                           weight_scale=scale)


def test_layers_stay_weight_only_where_w8a8_cannot_run(caplog):
    """On the CPU a dynamic-activation fp8 checkpoint gives the weight-only product at every
    batch size, and the log says why."""
    layer = _fp8_layer(48, 64)
    x = torch.randn(w8a8.MIN_ROWS + 6, 64)
    method = Fp8Method(QuantConfig("fp8", bits=8, kernel="torch", dynamic_activations=True))
    with caplog.at_level(logging.INFO, logger="tpserve.layers.quant.methods"):
        y = method.apply(layer, x)
    expected = TorchQuantKernel().fp8_matmul(x, layer.weight, layer.weight_scale)
    assert torch.equal(y, expected)
    assert "stay weight-only" in caplog.text and "NVIDIA GPUs only" in caplog.text


def test_why_not_names_the_dtype_and_shape():
    cpu = torch.zeros(2, 16)
    assert "NVIDIA" in w8a8.why_not(cpu, cpu)
