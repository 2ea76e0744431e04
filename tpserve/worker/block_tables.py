"""Each live sequence's block table, kept on the worker between steps (persistent batch
state): the engine sends a table once and then only the blocks it appends, and a step's
[batch, width] table is one numpy gather instead of a Python list per sequence."""

from __future__ import annotations

import numpy as np

from tpserve.engine.step import SeqStep


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 16) -> None:
        # Entries past a row's length may hold stale ids: any valid block id will do there
        # (kernels read only up to seq_lens), so rows are never cleared.
        self.table = np.zeros((rows, width), dtype=np.int64)
        self.rows: dict[int, int] = {}
        self.free = list(range(rows - 1, -1, -1))

    def update(self, seqs: list[SeqStep]) -> np.ndarray:
        """Apply this step's table updates; the row of each sequence, in order."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            row = self.rows.get(s.seq_id)
            if row is None:
                if s.blocks_from:
                    raise RuntimeError(f"sequence {s.seq_id}: an update from block "
                                       f"{s.blocks_from} for a table this worker never got "
                                       "(a tpserve bug)")
                row = self._new_row(s.seq_id)
            if s.block_table:
                end = s.num_blocks
                if end > self.table.shape[1]:
                    self._grow(width=max(end, 2 * self.table.shape[1]))
                self.table[row, s.blocks_from : end] = s.block_table
            out[i] = row
        return out

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free.append(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width] tables; freed (-1) entries and columns past the store read 0."""
        have = min(width, self.table.shape[1])
        out = np.zeros((len(rows), width), dtype=np.int64)
        out[:, :have] = self.table[rows, :have]
        out[out < 0] = 0
        return out

    def _new_row(self, seq_id: int) -> int:
        if not self.free:
            self._grow(rows=2 * self.table.shape[0])
        row = self.free.pop()
        self.rows[seq_id] = row
        return row

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self.table
        new = np.zeros((rows or old.shape[0], width or old.shape[1]), dtype=np.int64)
        new[: old.shape[0], : old.shape[1]] = old
        self.table = new
        self.free.extend(range(new.shape[0] - 1, old.shape[0] - 1, -1))
