"""Prefix caching: full KV blocks are named by a hash of every token up to their end, so a
request that starts with tokens another request already computed (a shared system prompt,
a conversation's earlier turns, a preempted sequence coming back) reuses those blocks
instead of recomputing them.

Blocks are reference-counted. A block nobody holds stays cached until it is needed for new
tokens; the least recently released cached block is reused first. Only decoder-only models
without a sliding window use it (the engine decides).

Per step the work is O(new blocks): a sequence's hashes are computed once, from slices of
its prompt and output (never the whole token list), and only blocks filled since its last
step are named. A block whose hash another block already holds is left unnamed; it is
looked at again only after such a hash was evicted (the one event that can change the
answer), which a counter records. A block holding a placeholder token (-1: a token still on
the device with overlapped steps) is never hashed; a later call hashes it once resolved.

A longrope model's keys depend on the factor set the sequence was rotated with
(Sequence.long_rope), not on the tokens alone: the chain of a long sequence starts from
another seed, so short and long sequences never share a block. So does a sequence served with
a LoRA adapter (Sequence.adapter): its keys and values are the adapter's, not the base
model's."""

from __future__ import annotations

from collections import OrderedDict

from tpserve.engine.block_manager import BlockManager
from tpserve.engine.sequence import Sequence

# The chain's seed per factor set: short (and every model without longrope), long.
_SEED = {False: 0, True: 1}


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
        # Hashes some block was refused because another block held them; evicting one of
        # them bumps _epoch, and a sequence named under an older epoch is looked at whole.
        self._shadowed: set[int] = set()
        self._epoch = 0
        self._named: dict[int, tuple[int, int]] = {}  # seq_id -> (blocks looked at, epoch)

    # --- allocation ---------------------------------------------------------------------
    def _take(self) -> int:
        block, _ = self._lru.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:
            self._by_hash.pop(old, None)
            if old in self._shadowed:
                self._shadowed.discard(old)
                self._epoch += 1
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            del self._refs[block]
            self._lru[block] = None  # stays cached until taken

    # --- sharing ------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._named.pop(seq.seq_id, None)

    def _chain(self, seq: Sequence, upto_block: int) -> list[int]:
        """seq's block hashes, extended up to upto_block full blocks where known (a block
        holding a placeholder -1 stops the chain until it is resolved)."""
        hashes, bs = seq.block_hashes, self.block_size
        prompt, out = seq.prompt_ids, seq.output_ids
        p = len(prompt)
        seed = _SEED[seq.long_rope]
        if seq.adapter:  # KV computed under a LoRA adapter is its own: the chain starts apart
            seed = (seed, seq.adapter)
        while len(hashes) < upto_block:
            i = len(hashes)
            lo, hi = i * bs, (i + 1) * bs
            if hi <= p:
                block = tuple(prompt[lo:hi])
            elif lo >= p:
                block = tuple(out[lo - p : hi - p])
            else:
                block = tuple(prompt[lo:] + out[: hi - p])
            if len(block) < bs or -1 in block:
                break
            hashes.append(hash((hashes[-1] if hashes else seed, block)))
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
        seen, epoch = self._named.get(seq.seq_id, (0, -1))
        start = seen if epoch == self._epoch else 0
        if start >= full:  # most decode steps: no block filled since the last look
            return
        hashes = self._chain(seq, full)
        upto = min(full, len(hashes))
        if start >= upto:
            return
        table, by_hash, hash_of = seq.block_table, self._by_hash, self._hash_of
        for i in range(start, upto):
            block, h = table[i], hashes[i]
            if block < 0 or block in hash_of:
                continue
            if h in by_hash:
                self._shadowed.add(h)
            else:
                by_hash[h] = block
                hash_of[block] = h
        self._named[seq.seq_id] = (upto, self._epoch)


class _FreeView:
    """The base class counts and tests free blocks through len(self._free)."""

    def __init__(self, lru: OrderedDict) -> None:
        self._lru = lru

    def __len__(self) -> int:
        return len(self._lru)
