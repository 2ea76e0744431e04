"""The tensor-core int4 GEMV of 1-16 rows, and 17-24 sixteen a launch (kernels/quant/triton_mma.py) against the float64
oracle of quant_conformance: bfloat16 and float16, every batch size it takes, groups of 64 and 128, symmetric and
not, whole and split K (in order sums by the last program), one to eight warps per program,
weights loaded one and two steps ahead,
and the shapes it must refuse (returns None, the caller keeps the other kernels). Inline PTX
does not run under Triton's interpreter, so this needs an NVIDIA GPU (sm_80+)."""

from __future__ import annotations

import pytest
import torch
from quant_conformance import _int4_ref, gated_ref, int4_case

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("mma.sync with bfloat16 needs sm_80+")
    return torch.device("cuda")


def _case(k, n, group, sym, m, seed, dtype=torch.bfloat16):
    dev = _cuda()
    qw, s, z, _, q = int4_case(k, n, group, sym, False, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ref = _int4_ref(x.double(), q, s.to(torch.float16), z.to(torch.float16), group, None)
    return (x.to(dev), qw.to(dev), s.to(dev, torch.float16), z.to(dev, torch.float16)), ref


def _rel(y, ref):
    return ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# float16 (the dtype GPTQ checkpoints usually declare) on a subset: the kernel differs only
# in its unpacking (16 + q under float16's exponent) and the mma's input type.
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # quant_conformance's
CASES = [pytest.param(k, n, group, torch.bfloat16, id=f"K{k}-N{n}-g{group}-bf16")
         for k, n in [(1024, 64), (4096, 192), (14336, 128), (512, 4096)]
         for group in (64, 128, 256)]
CASES += [pytest.param(k, n, group, torch.float16, id=f"K{k}-N{n}-g{group}-f16")
          for k, n in [(4096, 192), (14336, 128)] for group in (64, 128)]


@pytest.mark.parametrize("k,n,group,dtype", CASES)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_matches_the_oracle_at_every_batch_size_and_split(k, n, group, dtype, sym):
    from tpserve.kernels.quant.triton_kernel import MMA_WARPS, int4_mma_matmul

    seed = k + n + group + sym
    for m in (1, 2, 3, 5, 8, 9, 12, 16):
        (x, qw, s, z), ref = _case(k, n, group, sym, m, seed + m, dtype)
        for warps, split, ahead in ((0, 0, 0), (1, 1, 2), (2, 3, 1), (8, 5, 2), (4, 16, 1)):
            y = int4_mma_matmul(x, qw, s, z, group, warps=warps, split=split, ahead=ahead)
            if k // group < (warps or MMA_WARPS[m > 8]):  # fewer groups than warps: refused
                assert y is None
                continue
            assert y is not None and y.shape == (m, n) and y.dtype == dtype
            err = _rel(y, ref)
            assert err < TOL[dtype], f"K={k} N={n} g={group} M={m} {warps=} {split=}: {err}"
        # The kernel every layer uses (this path from MMA_MIN_ROWS rows, the GEMV below).
        from tpserve.kernels.quant.triton_kernel import TritonQuantKernel

        y = TritonQuantKernel().int4_matmul(x, qw, s, z, group)
        assert _rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_17_to_24_rows_sixteen_a_launch(dtype):
    """quant_matmul's 17-24 rows: the kernel once per 16 rows into one output (MMA_CHUNK_ROWS),
    split K included (N = 128 leaves programs to split)."""
    from tpserve.kernels.quant import triton_kernel as tk

    for m in (17, 20, 24):
        (x, qw, s, z), ref = _case(4096, 128, 128, False, m, 40 + m, dtype)
        launches = []
        real = tk._mma_launch

        def counting(x, *a, _real=real, _seen=launches, **kw):
            _seen.append(x.shape[0])
            return _real(x, *a, **kw)

        tk._mma_launch = counting
        try:
            y = tk.quant_matmul(x, qw, s, z, None, 128, False)
        finally:
            tk._mma_launch = real
        assert launches == [16, m - 16], launches
        assert y.shape == (m, 128) and _rel(y, ref) < TOL[dtype], (m, _rel(y, ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_gated_mlp_one_row(dtype):
    """A gated MLP's [gate; up] projection and its activation in one launch (gated): a
    program's 64 columns are 32 gate columns and their up columns; whole K and splits summed
    and gated by the last; silu and the tanh GELU; against the float64 oracle with the two
    launches' roundings. Also through quant_matmul, as the layers call it (float16 one row
    lands here; bfloat16 one row on the packed GEMV's gated launch)."""
    from tpserve.kernels.quant.triton_kernel import int4_mma_matmul, quant_matmul

    dev = _cuda()
    for k, n, group in ((4096, 256, 128), (14336, 128, 128), (1024, 4096, 64)):
        qw, s, z, _, q = int4_case(k, n, group, False, False, k + n)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(dtype)
        s16, z16 = s.to(torch.float16), z.to(torch.float16)
        args = (x.to(dev), qw.to(dev), s16.to(dev), z16.to(dev), group)
        for gelu in (False, True):
            ref = gated_ref(x, q, s16, z16, group, gelu)
            for split in (0, 1, 3):
                y = int4_mma_matmul(*args, split=split, gated=1 + gelu)
                assert y is not None and y.shape == (1, n // 2) and y.dtype == dtype
                err = _rel(y, ref)
                assert err < 2 * TOL[dtype], (k, n, group, gelu, split, err)
            y = quant_matmul(*args[:4], None, group, False, gated=1 + gelu)
            assert y is not None and _rel(y, ref) < 2 * TOL[dtype], (k, n, gelu)


@pytest.mark.parametrize("m", [1, 2, 9, 16])
def test_fragment_order_equals_row_major_bit_for_bit(m):
    """The weight in fragment order (quant/frag.py) puts the same words in the same
    registers, so the output equals the row-major kernel's exactly: plain and gated, whole
    K and split, bfloat16 and float16; and the gated launch's column order without the
    activation (paired, row-major or fragment order) equals the plain launch."""
    from tpserve.kernels.quant.frag import frag_pack
    from tpserve.kernels.quant.triton_kernel import int4_mma_matmul

    dev = _cuda()
    for dtype in (torch.bfloat16, torch.float16):
        for k, n, group in ((4096, 256, 128), (1024, 4096, 64)):
            qw, s, z, _, _ = int4_case(k, n, group, False, False, k + n + m)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            args = (x.to(dev), qw.to(dev), s.to(dev, torch.float16), z.to(dev, torch.float16),
                    group)
            for gated in ((0, 1) if m == 1 else (0,)):
                f = frag_pack(args[1], n // 2 if gated else 0)
                for split in (0, 1, 3):
                    want = int4_mma_matmul(*args, split=split, gated=gated)
                    got = int4_mma_matmul(*args, split=split, gated=gated, frag=f)
                    assert want is not None and torch.equal(got, want), (dtype, k, n, gated,
                                                                         split)
                    if not gated:  # the gated launch's columns, stored whole (paired)
                        fg = frag_pack(args[1], n // 2)
                        for frag in (None, fg):
                            got = int4_mma_matmul(*args, split=split, paired=True, frag=frag)
                            assert torch.equal(got, want), (dtype, k, n, split, frag is None)


@pytest.mark.parametrize("paired", [False, True])
def test_fragment_weight_of_many_rows_is_captured_in_a_graph(paired):
    """Above FRAG_MAX_ROWS rows a fragment-order weight is unpacked and dequantized for the
    vendor matmul; the mixed-step pieces capture that path, so it must not copy from the host
    (2026-12-05, H100: "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
    from the gated weight's column permutation)."""
    from tpserve.kernels.quant.frag import frag_pack
    from tpserve.kernels.quant.triton_kernel import FRAG_MAX_ROWS, _fragment_matmul

    k, n, group, m = 1024, 512, 128, FRAG_MAX_ROWS + 16
    (x, qw, s, z), ref = _case(k, n, group, False, m, 11)
    f = frag_pack(qw, n // 2 if paired else 0).view(n // 64, k // 64, 4, 32, 4)
    f.paired = paired
    eager = _fragment_matmul(x, f, s, z, group, 0, False)
    assert _rel(eager, ref) < TOL[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _fragment_matmul(x, f, s, z, group, 0, False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


def test_refuses_what_it_cannot_take():
    from tpserve.kernels.quant.triton_kernel import int4_mma_matmul

    (x, qw, s, z), _ = _case(1024, 128, 128, False, 1, 7)
    assert int4_mma_matmul(x, qw, s, z, 32) is None  # a group shorter than 64 inputs
    (x1, qw1, s1, z1), _ = _case(1024, 128, 1024, False, 2, 8)
    assert int4_mma_matmul(x1, qw1, s1, z1, 1024) is None  # one group per column (-1)
    assert int4_mma_matmul(x.repeat(17, 1), qw, s, z, 128) is None  # more than 16 rows
    assert int4_mma_matmul(x.float(), qw, s, z, 128) is None  # float32 activations
    assert int4_mma_matmul(x, qw[:, :96], s[:, :96], z[:, :96], 128) is None  # N % 64
    assert int4_mma_matmul(x, qw.t().contiguous().t(), s, z, 128) is None  # K-contiguous
