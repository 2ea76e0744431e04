"""Which int4 matmuls of 1-16 rows the tensor-core GEMV (kernels/quant/triton_mma.py) takes,
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


def test_float16_switched_off_and_act_order_keep_the_tiles_with_the_reason_logged_once(
        gpu_like, caplog, monkeypatch):
    monkeypatch.setattr(tk, "MMA_F16", False)  # TPSERVE_INT4_MMA_F16=0
    called = []
    monkeypatch.setattr(tk, "_mma_launch", lambda *a, **kw: called.append(a) or "y")
    x, qw, s, z = _tensors(dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger=tk.__name__):
        for _ in range(3):  # ... unless float16 is switched off
            assert tk._int4_rows_on_tensor_cores(x, qw, s, z, None, 128) is None
        g = torch.zeros(1024, dtype=torch.int32)
        assert tk._int4_rows_on_tensor_cores(x.bfloat16(), qw, s, z, g, 128) is None
        assert tk._int4_rows_on_tensor_cores(x.bfloat16(), qw, s, z, None, 128) == "y"
        monkeypatch.setattr(tk, "MMA_F16", True)
        assert tk._int4_rows_on_tensor_cores(x, qw, s, z, None, 128) == "y"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("TPSERVE_INT4_MMA_F16=0" in m for m in lines) == 1, lines
    assert sum("act-order" in m for m in lines) == 1
    # once per activation type: bfloat16 from 2 rows, float16 from 1
    assert sum("tensor-core GEMV (kernels/quant/triton_mma.py)" in m for m in lines) == 2
    assert len(called) == 2


class NotTheTensorCores(Exception):
    pass


@pytest.mark.parametrize("dtype,rows,launches", [
    (torch.bfloat16, 1, None), (torch.bfloat16, 2, [2]), (torch.float16, 1, [1]),
    (torch.float16, 16, [16]), (torch.bfloat16, 17, [16, 1]), (torch.float16, 24, [16, 8]),
    (torch.bfloat16, 25, None)])
def test_rows_that_take_it_by_default(gpu_like, monkeypatch, dtype, rows, launches):
    """One bfloat16 row keeps the packed GEMV (faster there); one float16 row, whose GEMV
    computes in float32, takes the tensor cores; 17-24 rows take them 16 rows a launch;
    above 24 the tiles."""
    for name in ("INT4_MMA", "MMA_F16"):
        monkeypatch.setattr(tk, name, True)
    monkeypatch.setattr(tk, "MMA_CHUNK_ROWS", 24)
    seen = []

    def fake(x, *a, out=None, **kw):
        seen.append(x.shape[0])
        y = x[:, :128].float() * 0 + 7 + len(seen)  # each launch its own value
        if out is not None:
            out.copy_(y)
        return y.to(x.dtype)

    def elsewhere(*a, **kw):
        raise NotTheTensorCores

    monkeypatch.setattr(tk, "_mma_launch", fake)
    monkeypatch.setattr(tk, "pick_tile", elsewhere)
    x, qw, s, z = _tensors(m=rows, dtype=dtype)
    assert tk.MMA_MIN_ROWS[dtype] == {torch.bfloat16: 2, torch.float16: 1}[dtype]
    if launches is None:
        with pytest.raises(NotTheTensorCores):
            tk.quant_matmul(x, qw, s, z, None, 128, fp8=False)
        return
    y = tk.quant_matmul(x, qw, s, z, None, 128, fp8=False)
    assert seen == launches and y.shape == (rows, 128)
    for i, n in enumerate(launches):  # launch i wrote rows 16 i .. 16 i + n
        assert bool((y[16 * i:16 * i + n] == 8 + i).all()), i
