"""Fixed-size KV-cache blocks: a free list and per-sequence block tables.

An encoder-decoder sequence also holds cross blocks: the cross-attention K/V of its encoder
output, computed once when its decoder starts. They come from the same pool (every decoder
layer's cache has a slot for them), so memory is accounted in one place."""

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

    def cross_blocks_needed(self, seq: Sequence) -> int:
        """Blocks for the encoder output's cross K/V that seq does not hold yet."""
        if seq.encoder_ids is None or seq.cross_block_table:
            return 0
        return -(-len(seq.encoder_ids) // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs to hold num_tokens tokens (and its cross K/V, if any)."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need < 0:
            need = 0
        if seq.encoder_ids is not None and not seq.cross_block_table:
            need += -(-len(seq.encoder_ids) // self.block_size)
        return need

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need == 0:  # most decode steps: the last block still has room
            return
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self._free)}")
        cross = self.cross_blocks_needed(seq)
        take = self._take
        if cross:
            seq.cross_block_table.extend([take() for _ in range(cross)])
        seq.block_table.extend([take() for _ in range(need - cross)])

    def _take(self) -> int:
        return self._free.pop()

    def _release(self, block: int) -> None:
        self._free.append(block)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            if b >= 0:
                self._release(b)
        for b in reversed(seq.cross_block_table):
            self._release(b)
        seq.block_table = []
        seq.cross_block_table = []

    def shrink(self, seq: Sequence) -> int:
        """Free the blocks past those seq's cached tokens need (speculative decoding: the
        blocks grown for drafts the target rejected). Returns how many were freed."""
        keep = -(-seq.num_computed // self.block_size)
        extra = seq.block_table[keep:]
        del seq.block_table[keep:]
        for b in reversed(extra):
            if b >= 0:
                self._release(b)
        return len(extra)

    def reuse_prefix(self, seq: Sequence) -> None:
        """Hook for prefix caching (prefix_cache.py); plain blocks share nothing."""

    def after_compute(self, seq: Sequence) -> None:
        """Hook called once seq.num_computed has advanced."""

    def release_outside_window(self, seq: Sequence, window: int) -> int:
        """Free blocks no future query can see. The next query sits at position
        seq.num_computed and sees keys k > q - window, so a block whose last position is
        <= num_computed - window is dead for good. Returns how many were freed."""
        freed = 0
        last_dead = (seq.num_computed - window + 1) // self.block_size  # blocks [0, last_dead)
        for i in range(min(last_dead, len(seq.block_table))):
            if seq.block_table[i] >= 0:
                self._release(seq.block_table[i])
                seq.block_table[i] = -1
                freed += 1
        return freed
