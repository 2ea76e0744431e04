"""quant/frag.py: the fragment-order int4 weight holds, at each lane's four 16-byte pieces,
exactly the words the tensor-core GEMV loads from the row-major weight (plain and gated
column blocks), and refuses shapes it cannot block. Runs on the CPU (the kernel's own
bit-for-bit check against row-major is test_int4_mma.py's, on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.quant.frag import block_columns, frag_pack, lane_words


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
