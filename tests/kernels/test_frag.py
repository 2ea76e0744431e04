"""quant/frag.py: the fragment-order int4 weight holds, at each lane's four 16-byte pieces,
exactly the words the tensor-core GEMV loads from the row-major weight (plain and gated
column blocks), and refuses shapes it cannot block. Runs on the CPU (the kernel's own
bit-for-bit check against row-major is test_int4_mma.py's, on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.quant.frag import block_columns, frag_pack, frag_unpack, lane_words


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_each_lane_finds_its_words(gated):
    k, n = 192, 256
    q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(int(gated)))
    up = n // 2 if gated else 0
    f = frag_pack(q, up)
    assert f.shape == (k * n // 8,) and f.dtype == torch.int32
    steps = k // 64
    for block in range(n // 64):
        for step in range(steps):
            for lane in range(32):
                at = (block * steps + step) * 512 + lane * 4
                got = [int(f[at + 128 * i + w]) for i in range(4) for w in range(4)]
                assert got == lane_words(q, block, step, lane, up), (block, step, lane)


def test_every_word_once():
    """A permutation: every word of the weight lands once (nothing dropped or doubled)."""
    q = torch.arange(32 * 128, dtype=torch.int32).view(32, 128)
    for up in (0, 64):
        assert torch.equal(frag_pack(q, up).sort().values, q.reshape(-1))
        assert torch.equal(block_columns(128, up).sort().values, torch.arange(128))


def test_refuses_unblockable_shapes():
    with pytest.raises(ValueError, match="N % 64"):
        frag_pack(torch.zeros(8, 96, dtype=torch.int32))
    with pytest.raises(ValueError, match="K % 64"):
        frag_pack(torch.zeros(4, 64, dtype=torch.int32))


def test_blocked_one_row_gemv_equals_row_major_under_the_interpreter():
    """The one-row GEMV reading a column-blocked weight (frag.blocked_pack, BLOCKED) gives
    the row-major GEMV's output exactly: plain and gated, whole K and split, in float32 and
    bfloat16 (the interpreter runs the float32 arithmetic; the packed bfloat16x2 path is PTX,
    checked on a GPU by benchmarks/int4_mma_bench.py --frag)."""
    from test_quant_kernels import _interpret

    _interpret("""
        from quant_conformance import int4_case
        from tpserve.kernels.quant import triton_kernel as tk
        from tpserve.kernels.quant.frag import blocked_pack
        from tpserve.kernels.quant.triton_tiles import Tile

        for k, n, group in ((256, 64, 32), (512, 128, 128)):
            qw, s, z, _, _ = int4_case(k, n, group, False, False, k + n)
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(dt)
                for split in (1, 2):
                    tile = Tile(block_m=0, block_n=16, block_k=64, split=split)
                    for gated in (0, 1):
                        b = blocked_pack(qw, 16, n // 2 if gated else 0)
                        want = tk.quant_matmul(x, qw, s, z, None, group, False, tile=tile,
                                               gated=gated)
                        got = tk.quant_matmul(x, qw, s, z, None, group, False, tile=tile,
                                              gated=gated, blocked_w=b)
                        assert want is not None and torch.equal(got, want), (k, dt, split,
                                                                             gated)
        print("ok")
    """)


@pytest.mark.parametrize("up", [0, 128])
def test_unpack_inverts_pack(up):
    q = torch.randint(-2**31, 2**31 - 1, (24, 256), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(up))
    assert torch.equal(frag_unpack(frag_pack(q, up), 192, 256, up), q)
