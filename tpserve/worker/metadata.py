"""Step inputs: the one place AttentionMetadata is built (eager steps, the encoder, cross
attention and the decode graphs all come through make_metadata).

Host-side inputs are built with numpy and reach the device in ONE copy: every integer array
of a step is packed into one int64 buffer (pinned when the device is an accelerator), copied
with non_blocking=True and split into views on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tpserve.engine.step import SeqStep
from tpserve.kernels.base import AttentionMetadata


def make_metadata(starts: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                  slots: torch.Tensor, query_lens: tuple[int, ...],
                  seq_lens_host: tuple[int, ...], max_seq_len: int | None = None
                  ) -> AttentionMetadata:
    """Device tensors plus their host shapes; max_seq_len defaults to max(seq_lens_host)."""
    if max_seq_len is None:
        max_seq_len = max(seq_lens_host)
    return AttentionMetadata(
        query_start_loc=starts, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
        max_query_len=max(query_lens), max_seq_len=max_seq_len,
        query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens_host))


@dataclass
class PagedInputs:
    ids: torch.Tensor  # int64 [T] on the device
    # int64 [T]: the rows of the rotary table, the only use of positions on the device:
    # each token's position, plus the sequence's rope offset (longrope's long half).
    rope_positions: torch.Tensor
    meta: AttentionMetadata
    extra: list[torch.Tensor]  # the caller's extra int64 arrays, on the device


def padded_tables(tables: list[list[int]], fill: int = 0) -> np.ndarray:
    """[B, widest] int64; freed (-1) and missing entries point at `fill`, a valid block."""
    width = max(1, max(len(t) for t in tables))
    out = np.full((len(tables), width), fill, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    out[out < 0] = fill
    return out


def rope_offsets(seqs: list[SeqStep], long_offset: int | None) -> np.ndarray | None:
    """Each sequence's shift into the rotary table (int64 [B]): long_offset for a sequence
    rotated with longrope's long factors (SeqStep.long_rope), else 0; None when no sequence
    of the step is shifted."""
    if not long_offset or not any(s.long_rope for s in seqs):
        return None
    return np.fromiter((long_offset if s.long_rope else 0 for s in seqs), dtype=np.int64,
                       count=len(seqs))


def build_paged_inputs(token_ids: list[list[int]], starts_pos: list[int],
                       tab: np.ndarray, block_size: int, staging: HostStaging,
                       extra: list[np.ndarray] = (),
                       rope_offsets: np.ndarray | None = None) -> PagedInputs:
    """Sequence i brings token_ids[i] at positions starts_pos[i].. and owns the blocks of
    tab[i] (int64 [B, width], every entry a valid block id). `extra` int64 arrays travel in
    the same copy. rope_offsets (int64 [B]) shift each sequence's rotary rows only: slots,
    lengths and masks keep the true positions."""
    q_lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
    start = np.asarray(starts_pos, dtype=np.int64)
    seq_lens = start + q_lens
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(cu[-1], dtype=np.int64) - cu[:-1][seq_of_token] + start[seq_of_token]
    slots = tab[seq_of_token, positions // block_size] * block_size + positions % block_size
    ids = np.fromiter((t for seq in token_ids for t in seq), dtype=np.int64, count=int(cu[-1]))
    rope = positions if rope_offsets is None else positions + rope_offsets[seq_of_token]
    ids_d, pos_d, slots_d, cu_d, lens_d, tab_d, *extra_d = staging.to_device(
        [ids, rope, slots, cu, seq_lens, tab.reshape(-1), *extra])
    meta = make_metadata(cu_d.int(), lens_d.int(), tab_d.view(tab.shape).int(), slots_d,
                         tuple(q_lens.tolist()), tuple(seq_lens.tolist()))
    return PagedInputs(ids_d, pos_d, meta, extra_d)


class HostStaging:
    """int64 arrays -> device tensors through one packed host buffer and one copy.

    On an accelerator the buffers are pinned and preallocated (grown when a step needs more),
    so the copy is asynchronous and nothing is allocated per step. Two buffers take turns:
    with overlapped steps a step's copy waits on the device behind the step before it, and
    the host, already preparing the step after, must not wait for that; before a buffer is
    overwritten, the copy out of it (two steps back) is waited for by an event.
    On the CPU the packed array is used in place.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.Event | None] = [None, None]
        self._turn = 0

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        flat = [a.reshape(-1) for a in arrays]
        if self.device.type == "cpu":
            return list(torch.from_numpy(np.concatenate(flat)).split(sizes))
        total = sum(sizes)
        t = self._turn = 1 - self._turn
        buf = self._bufs[t]
        if self._copied[t] is not None:
            self._copied[t].synchronize()
        if buf is None or buf.numel() < total:
            buf = self._bufs[t] = torch.empty(
                max(total, 2 * (0 if buf is None else buf.numel())), dtype=torch.int64,
                pin_memory=True)
        np.concatenate(flat, out=buf.numpy()[:total])
        packed = buf[:total].to(self.device, non_blocking=True)
        self._copied[t] = torch.Event(device=self.device)
        self._copied[t].record()
        return list(packed.split(sizes))
