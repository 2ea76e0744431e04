"""Prefix caching: full KV blocks are named by a hash of every token up to their end, so a
request that starts with tokens another request already computed (a shared system prompt,
a conversation's earlier turns, a preempted sequence coming back) reuses those blocks
instead of recomputing them.

Blocks are reference-counted. A block nobody holds stays cached until it is needed for new
tokens; the least recently released cached block is reused first. Only decoder-only models
without a sliding window use it (the engine decides)."""

from __future__ import annotations

from collections import OrderedDict

from tpserve.engine.block_manager import BlockManager
from tpserve.engine.sequence import Sequence
from tpserve.engine.step import PENDING_TOKEN


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # Free blocks in release order (oldest first); values unused.
        self._lru: OrderedDict[int, None] = OrderedDict((b, None) for b in reversed(self._free))
        self._free = _FreeView(self._lru)
        self._refs: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.hits = 0  # blocks reused, for metrics and tests

    # --- allocation ---------------------------------------------------------------------
    def _take(self) -> int:
        block, _ = self._lru.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:
            self._by_hash.pop(old, None)
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            del self._refs[block]
            self._lru[block] = None  # stays cached until taken

    # --- sharing ------------------------------------------------------------------------
    def _chain(self, seq: Sequence, upto_block: int) -> list[int]:
        hashes = seq.block_hashes
        ids, bs = seq.all_ids, self.block_size
        while len(hashes) < upto_block:
            i = len(hashes)
            prev = hashes[-1] if hashes else 0
            block = tuple(ids[i * bs : (i + 1) * bs])
            if PENDING_TOKEN in block:  # a token still on the device: named once known
                break
            hashes.append(hash((prev, block)))
        return hashes

    def reuse_prefix(self, seq: Sequence) -> None:
        """Attach the cached blocks of seq's longest cached prefix. At least one token is
        left to compute, since the next token's logits come from it."""
        if seq.block_table or seq.params.prompt_logprobs:
            return
        usable = (seq.num_tokens - 1) // self.block_size
        for h in self._chain(seq, usable):
            block = self._by_hash.get(h)
            if block is None:
                break
            if block in self._lru:
                del self._lru[block]
            self._refs[block] = self._refs.get(block, 0) + 1
            seq.block_table.append(block)
            self.hits += 1
        seq.num_computed = len(seq.block_table) * self.block_size

    def after_compute(self, seq: Sequence) -> None:
        """Name the blocks seq has just filled, so later requests can find them."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        for i, h in enumerate(self._chain(seq, full)):
            block = seq.block_table[i]
            if block >= 0 and block not in self._hash_of and h not in self._by_hash:
                self._by_hash[h] = block
                self._hash_of[block] = h


class _FreeView:
    """The base class counts and tests free blocks through len(self._free)."""

    def __init__(self, lru: OrderedDict) -> None:
        self._lru = lru

    def __len__(self) -> int:
        return len(self._lru)
