"""Fixed-size KV-cache blocks: a free list and per-sequence block tables."""

from __future__ import annotations

from tpserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token "
                             f"(num_blocks={num_blocks}, block_size={block_size})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs to hold num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self._free)}")
        seq.block_table.extend(self._free.pop() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self._free.extend(b for b in reversed(seq.block_table) if b >= 0)
        seq.block_table = []

    def release_outside_window(self, seq: Sequence, window: int) -> int:
        """Free blocks no future query can see. The next query sits at position
        seq.num_computed and sees keys k > q - window, so a block whose last position is
        <= num_computed - window is dead for good. Returns how many were freed."""
        freed = 0
        last_dead = (seq.num_computed - window + 1) // self.block_size  # blocks [0, last_dead)
        for i in range(min(last_dead, len(seq.block_table))):
            if seq.block_table[i] >= 0:
                self._free.append(seq.block_table[i])
                seq.block_table[i] = -1
                freed += 1
        return freed
