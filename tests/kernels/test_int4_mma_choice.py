"""Which int4 matmuls of 2-16 rows the tensor-core GEMV (kernels/quant/triton_mma.py) takes,
and the reasons logged for the ones it does not, decided on the CPU with the GPU checks
stubbed (the kernel itself runs on GPUs only: tests/kernels/test_int4_mma.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tpserve.kernels.quant import triton_kernel as tk


@pytest.fixture
def gpu_like(monkeypatch):
    """The CPU passes for an sm_80+ NVIDIA GPU; no log line has been said yet."""
    monkeypatch.setattr(tk, "_ptx", lambda device: True)
    monkeypatch.setattr(tk, "_mma_capable", lambda device: True)
    monkeypatch.setattr(tk, "_LOGGED", set())


def _tensors(m=4, k=1024, n=128, dtype=torch.bfloat16):
    x = torch.randn(m, k).to(dtype)
    qw = torch.zeros(k // 8, n, dtype=torch.int32)
    s = torch.ones(k // 128, n, dtype=torch.float16)
    return x, qw, s, s.clone()


def test_what_it_takes_and_why_it_refuses(gpu_like):
    x, qw, s, z = _tensors()
    assert tk.mma_refusal(x, qw, s, z, 128) == ""
    assert "17 rows" in tk.mma_refusal(x.repeat(5, 1)[:17], qw, s, z, 128)
    assert "torch.float32" in tk.mma_refusal(x.float(), qw, s, z, 128)
    assert "group size 32" in tk.mma_refusal(x, qw, s, z, 32)
    assert "group(s) per column" in tk.mma_refusal(x, qw, s[:1], z[:1], 1024)
    assert "100 output columns" in tk.mma_refusal(x, qw[:, :100], s[:, :100], z[:, :100], 128)
    assert "row-major" in tk.mma_refusal(x, qw.t().contiguous().t(), s, z, 128)
    assert "float16" in tk.mma_refusal(x, qw, s.float(), z.float(), 128)
    assert tk.mma_refusal(x.half(), qw, s, z, 128) == ""  # the kernel takes float16 ...


def test_float16_and_act_order_keep_the_tiles_with_the_reason_logged_once(gpu_like, caplog,
                                                                           monkeypatch):
    monkeypatch.setattr(tk, "MMA_F16", False)
    called = []
    monkeypatch.setattr(tk, "_mma_launch", lambda *a, **kw: called.append(a) or "y")
    x, qw, s, z = _tensors(dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger=tk.__name__):
        for _ in range(3):  # ... but dispatch asks for it to be opted in
            assert tk._int4_rows_on_tensor_cores(x, qw, s, z, None, 128) is None
        g = torch.zeros(1024, dtype=torch.int32)
        assert tk._int4_rows_on_tensor_cores(x.bfloat16(), qw, s, z, g, 128) is None
        assert tk._int4_rows_on_tensor_cores(x.bfloat16(), qw, s, z, None, 128) == "y"
        monkeypatch.setattr(tk, "MMA_F16", True)
        assert tk._int4_rows_on_tensor_cores(x, qw, s, z, None, 128) == "y"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("TPSERVE_INT4_MMA_F16=1" in m for m in lines) == 1, lines
    assert sum("act-order" in m for m in lines) == 1
    assert sum("tensor-core GEMV (kernels/quant/triton_mma.py)" in m for m in lines) == 1
    assert len(called) == 2
