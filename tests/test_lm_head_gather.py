"""ParallelLMHead.compute_logits(to_first_rank=True): the full logits on tp rank 0 only, equal
to a plain h W^T over the whole vocabulary; None on the other ranks. Two gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, HIDDEN, TP = 11, 8, 2  # 11 does not divide by 2: the padded row is cut off


def _rank(rank: int, init: str, results) -> None:
    from tpserve.distributed import TPInfo, reset_tp, set_tp
    from tpserve.layers.embedding import ParallelLMHead

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=TP)
    try:
        set_tp(TPInfo(rank, TP))
        gen = torch.Generator().manual_seed(0)
        full = torch.randn(VOCAB, HIDDEN, generator=gen)
        hidden = torch.randn(3, HIDDEN, generator=gen)
        head = ParallelLMHead(VOCAB, HIDDEN)
        mine = torch.zeros(head.rows_per_rank, HIDDEN)
        real = full[head.start:min(head.end, VOCAB)]
        mine[: real.shape[0]] = real
        head.weight.data.copy_(mine)
        first = head.compute_logits(hidden, to_first_rank=True)
        everywhere = head.compute_logits(hidden)
        results[rank] = (first, everywhere, hidden @ full.T)
        reset_tp()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch
def test_logits_gathered_to_the_first_rank_only(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path}/rendezvous", results))
                 for r in range(TP)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        first0, every0, ref = results[0]
        first1, every1, _ = results[1]
    torch.testing.assert_close(first0, ref)
    assert first1 is None
    torch.testing.assert_close(every0, ref)
    torch.testing.assert_close(every1, ref)
