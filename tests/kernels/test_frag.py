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


def test_fragment_weight_takes_the_dense_path_above_64_rows_under_the_interpreter():
    """A fragment-order weight (as int4_pack makes it) above FRAG_MAX_ROWS rows is unpacked
    and dequantized: the same product as the row-major weight's dense path, plain and
    paired; fused launches it cannot do come back None (the layer then runs them apart)."""
    from test_quant_kernels import _interpret

    _interpret("""
        from quant_conformance import int4_case
        from tpserve.kernels.quant import triton_kernel as tk
        from tpserve.kernels.quant.frag import frag_pack

        k, n, group = 256, 128, 64
        qw, s, z, _, _ = int4_case(k, n, group, False, False, 7)
        x = torch.randn(tk.FRAG_MAX_ROWS + 3, k, generator=torch.Generator().manual_seed(1))
        want = tk.quant_matmul(x, qw, s, z, None, group, False)
        for paired in (False, True):
            f = frag_pack(qw, n // 2 if paired else 0).view(n // 64, k // 64, 4, 32, 4)
            f.paired = paired
            assert tk.is_fragment(f) and not tk.is_fragment(qw)
            got = tk.quant_matmul(x, f, s, z, None, group, False)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), paired
            one = x[:1]
            assert tk.quant_matmul(one, f, s, z, None, group, False,
                                   rms=(torch.ones(k), 1e-6)) is None
            assert tk.quant_matmul(one, f, s, z, None, group, False,
                                   residual=torch.zeros(1, n)) is None
            if not paired:  # a gated launch needs the paired column order
                assert tk.quant_matmul(one, f, s, z, None, group, False, gated=1) is None
        print("ok")
    """)


def test_layers_keep_the_stored_order_where_the_kernel_has_no_layout_of_its_own():
    """On the CPU (the torch reference) int4_pack keeps the stored order: pack() changes
    nothing, and the Triton kernel declines too off CUDA or with TPSERVE_INT4_LAYOUT=rows."""
    from tpserve.kernels.quant.torch_ref import TorchQuantKernel
    from tpserve.kernels.quant.triton_kernel import TritonQuantKernel

    qw = torch.zeros(16, 128, dtype=torch.int32)
    s = torch.ones(2, 128, dtype=torch.float16)
    for kernel in (TorchQuantKernel(), TritonQuantKernel()):
        assert kernel.int4_pack(qw, s, s, 64, None, torch.bfloat16, True) is None


def test_a_kernels_private_layout_serves_like_the_stored_one(tmp_path, monkeypatch):
    """The warmup hook end to end: a kernel whose int4_pack returns its own layout (here the
    reference with qweight transposed) gets every int4 layer repacked once, [gate; up] marked
    paired, and the engine then serves exactly what transformers does on the dequantized
    weights (a layer reading the wrong layout would not)."""
    from engine_utils import assert_matches_reference, make_engine
    from quant_checkpoints import quantized_with_reference
    from tiny_models import PROMPTS

    from tpserve.kernels.quant.torch_ref import TorchQuantKernel
    from tpserve.layers.quant.methods import Int4Method

    packed = []

    def pack(self, qweight, scales, zeros, group_size, g_idx, dtype, paired):
        packed.append(paired)
        t = qweight.t().contiguous()[None]  # [1, N, K / 8]: unlike the stored order
        t.paired = paired
        return t

    plain = TorchQuantKernel.int4_matmul

    def matmul(self, x, qweight, *args):
        if qweight.dim() == 3:
            qweight = qweight[0].t()
        return plain(self, x, qweight, *args)

    monkeypatch.setattr(TorchQuantKernel, "int4_pack", pack)
    monkeypatch.setattr(TorchQuantKernel, "int4_matmul", matmul)
    path, ref_tokens, ref_logits = quantized_with_reference(
        tmp_path, "llama-gptq-frag", "llama", dict(fmt="gptq", group=32, sym=False))
    engine = make_engine(path, 1, local=True)
    try:
        layers = [m for m in engine.executor.worker.model.modules()
                  if isinstance(getattr(m, "method", None), Int4Method)]
        assert layers and all(m.qweight.dim() == 3 for m in layers)
        assert len(packed) == len(layers) and any(packed) and not all(packed)
        assert all(m.method.pack(m, torch.float32) is False for m in layers)  # once only
        assert_matches_reference(engine, PROMPTS, ref_tokens, ref_logits)
    finally:
        engine.shutdown()
