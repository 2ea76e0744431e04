"""Fused layer kernels against their torch reference (tests/kernels/fused_conformance.py).

On the CPU: the real Triton kernels under Triton's interpreter when triton is installed (CI
without triton reports the test as skipped, with that reason), and the suite's own ability to
catch a wrong kernel. On a CUDA machine (`-m gpu`): every dtype and head_dims 64/128/256.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_conformance import run_fused_conformance
from interpreter import run_interpreted

from tpserve.kernels import fused_ops as fo
from tpserve.kernels import kv_quant


def test_cpu_tensors_take_the_torch_path():
    assert not fo.use_triton(torch.zeros(1))


@pytest.mark.parametrize("heads_per_program", [1, 2, 4, 8])
def test_rotary_warps_are_powers_of_two(heads_per_program):
    """Triton refuses other warp counts at launch (the interpreter does not check): 8 heads
    of 96 (Phi-3) asked for 3 and failed a CUDA launch at start-up."""
    for head_dim in range(8, 520, 8):
        warps = fo.rotary_warps(heads_per_program, head_dim)
        assert warps in (1, 2, 4), (heads_per_program, head_dim, warps)
        if heads_per_program > 1:  # about a warp per 256 values, never more
            assert warps <= max(1, heads_per_program * head_dim // 256), (heads_per_program,
                                                                           head_dim)


@pytest.mark.slow  # Triton's interpreter: about a minute on two cores
def test_triton_fused_kernels_under_the_interpreter():
    out = run_interpreted("""
        import torch
        from fused_conformance import run_fused_conformance, as_markdown
        cases = run_fused_conformance("cpu", (torch.float32, torch.bfloat16, torch.float16),
                                      head_dims=(64, 256))
        print(as_markdown(cases))
        # The interpreter's bfloat16 truncation and fp8 emulation (fused_conformance.py)
        # stack up in the fp8-cache bfloat16 cases: reported, not held to the tolerance.
        assert all(c.ok for c in cases if not ("[fp8]" in c.kernel and c.dtype == "bfloat16"))
    """)
    assert "rotary_write_kv | bfloat16 | 12 | 0" in out
    assert "rotary_write_kv (fp8 cache) | float32 | 12 | 0" in out
    assert "rotary_write_kv (fp8 cache) | float16 | 12 | 0" in out


def test_suite_fails_wrong_kernels(monkeypatch):
    """Stand-ins with one bug each (gelu computed as silu, a norm without its offset, keys
    not rotated) must fail exactly their cases; correct stand-ins pass."""
    monkeypatch.setattr(fo, "gated_act_triton", lambda x, gelu: fo.gated_act_torch(x, F.silu))
    monkeypatch.setattr(fo, "add_rms_norm_triton",
                        lambda x, r, w, eps, off, cf: fo.add_rms_norm_torch(x, r, w, eps, 0.0, cf))

    def unrotated_keys(q, k, v, cos, sin, k_cache, v_cache, slots, *scales, **_tiling):
        d = k.shape[-1]
        k_cache.view(-1, k.shape[1], d)[slots] = k.to(k_cache.dtype)
        v_cache.view(-1, k.shape[1], d)[slots] = v.to(v_cache.dtype)
        return fo.apply_rotary_torch(q, cos, sin)

    monkeypatch.setattr(fo, "rotary_write_kv_triton", unrotated_keys)
    cases = run_fused_conformance("cpu", (torch.float32,), head_dims=(64,))
    failed = {c.kernel.split("[")[0] for c in cases if not c.ok}
    assert failed == {"gelu_pytorch_tanh_and_mul", "add_rms_norm", "rotary_write_kv"}
    assert not any(not c.ok for c in cases if c.kernel == "add_rms_norm[llama]")
    assert all(c.ok for c in cases if c.kernel == "silu_and_mul")


def _torch_rotary_write(q, k, v, cos, sin, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0,
                        quantize=kv_quant.quantize, heads_per_program=None):
    """rotary_write_kv_triton's contract in torch, with a swappable quantizer."""
    d, hkv = k.shape[-1], k.shape[1]
    rk = fo.apply_rotary_torch(k, cos, sin)
    if kv_quant.is_fp8(k_cache):
        rk, v = quantize(rk, k_scale), quantize(v, v_scale)
    k_cache.view(-1, hkv, d)[slots] = rk.to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[slots] = v.to(v_cache.dtype)
    return fo.apply_rotary_torch(q, cos, sin)


def test_fp8_rotary_cases_pass_a_correct_write_and_fail_one_that_drops_the_scales(monkeypatch):
    """The fp8 rotary cases: the contract written in torch passes; the same write with the
    scales ignored (stored as if both were 1.0) fails exactly the fp8 cases."""
    monkeypatch.setattr(fo, "add_rms_norm_triton", fo.add_rms_norm_torch)
    monkeypatch.setattr(fo, "gated_act_triton", lambda x, gelu: fo.gated_act_torch(x, F.silu))
    monkeypatch.setattr(fo, "rotary_write_kv_triton", _torch_rotary_write)
    cases = [c for c in run_fused_conformance("cpu", (torch.float32,), head_dims=(64,))
             if c.kernel.startswith("rotary")]
    assert sum("[fp8]" in c.kernel for c in cases) == 6 and all(c.ok for c in cases)

    def drops_scales(*args, **_tiling):
        return _torch_rotary_write(*args[:8], quantize=lambda x, _s: kv_quant.quantize(x, 1.0))

    monkeypatch.setattr(fo, "rotary_write_kv_triton", drops_scales)
    cases = [c for c in run_fused_conformance("cpu", (torch.float32,), head_dims=(64,))
             if c.kernel.startswith("rotary")]
    assert {c.kernel for c in cases if not c.ok} == {"rotary_write_kv[fp8]"}
    assert all(not c.ok for c in cases if "[fp8]" in c.kernel)


@pytest.mark.gpu
def test_fused_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cases = run_fused_conformance("cuda", (torch.float32, torch.bfloat16, torch.float16),
                                  head_dims=(64, 128, 256))
    bad = [c for c in cases if not c.ok]
    assert not bad, bad


def test_layers_plan_their_fused_variants_for_warmup():
    from tpserve.layers.activation import GatedActivation
    from tpserve.layers.norm import RMSNorm

    RMSNorm(96, 1e-6, offset=1.0, cast_before_weight=False)
    GatedActivation("gelu_pytorch_tanh")
    assert (96, 1.0, False) in fo._PLANNED_NORMS and True in fo._PLANNED_ACTS
    assert fo.warmup(torch.device("cpu"), torch.float32) == 0  # the CPU serves on torch


@pytest.mark.slow  # Triton's interpreter: about 5 s on two cores
def test_fused_rotary_write_of_a_padded_head_under_the_interpreter():
    """DeepSeek-V3's 192-wide heads, padded to 256 inside the kernel: q rotated and the
    keys and values stored (float and fp8 caches) match the torch path, and no neighbouring
    head's cache row is touched (the comparison covers the whole cache)."""
    out = run_interpreted("""
        import torch
        from fused_conformance import FP8_TOLERANCE, TOLERANCE, _rotary_cases
        gen = torch.Generator().manual_seed(0)
        cases = list(_rotary_cases(torch.device("cpu"), torch.float32, gen, (192,)))
        limit = {True: FP8_TOLERANCE, False: TOLERANCE[torch.float32]}
        assert len(cases) == 12, cases
        assert all(err <= limit["[fp8]" in name] for name, _, err in cases), cases
        print("match")
    """)
    assert "match" in out
