"""Which replica a request goes to: the least outstanding work, unless a replica that already
holds the request's prefix in its prefix cache is not much busier.

Plain Python (no Ray), so it is tested on its own; tpserve/serve/router.py adapts it to Ray
Serve's RequestRouter. The router sees prompts as text (it does not tokenize), so prefixes
are tracked as hashes of fixed-size character chunks and work is estimated in tokens.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# A rough characters-per-token ratio for English text; only used to weigh prompts against
# generated tokens, never to decide validity.
CHARS_PER_TOKEN = 4


def estimate_tokens(prompt: str, max_new_tokens: int) -> int:
    """Work a request adds to a replica: its prompt (prefill) plus the tokens it may generate."""
    return len(prompt) // CHARS_PER_TOKEN + 1 + max(0, max_new_tokens)


@dataclass(frozen=True)
class PolicyConfig:
    chunk_chars: int = 64          # prefix granularity (~16 tokens, a KV block at block size 16)
    max_chunks: int = 64           # longest prefix tracked (4096 characters)
    imbalance_tokens: int = 1024   # a prefix-holding replica may be this much busier ...
    imbalance_ratio: float = 0.5   # ... or this fraction of the least-loaded one's work
    prefixes_per_replica: int = 8192  # remembered chunk hashes per replica (LRU)


class PrefixAwareLeastWork:
    """Ranks replicas for one request; remembers what it routed where.

    A replica's work is the larger of what it last reported (queued plus running tokens,
    across every router) and what this router sent it that has not completed yet (fresh,
    but only this router's share).
    """

    def __init__(self, config: PolicyConfig | None = None, seed: int | None = None) -> None:
        self.config = config or PolicyConfig()
        self._outstanding: dict[str, int] = {}
        # Per replica: chunk hash -> how many routed requests carried it (LRU order).
        self._prefixes: dict[str, OrderedDict[int, int]] = {}
        self._rng = random.Random(seed)
        self.prefix_preferred = 0  # rankings that put a prefix holder first
        self.routed = 0

    # --- state --------------------------------------------------------------------------
    def on_routed(self, replica: str, prompt: str, cost: int) -> None:
        self.routed += 1
        self._outstanding[replica] = self._outstanding.get(replica, 0) + cost
        seen = self._prefixes.setdefault(replica, OrderedDict())
        for h in self.prefix_hashes(prompt):
            seen[h] = seen.get(h, 0) + 1
            seen.move_to_end(h)
        while len(seen) > self.config.prefixes_per_replica:
            seen.popitem(last=False)

    def on_completed(self, replica: str, cost: int) -> None:
        left = self._outstanding.get(replica, 0) - cost
        self._outstanding[replica] = max(0, left)

    def forget(self, replica: str) -> None:
        """A replica died or was removed: its cache is gone with it."""
        self._outstanding.pop(replica, None)
        self._prefixes.pop(replica, None)

    def outstanding(self, replica: str) -> int:
        return self._outstanding.get(replica, 0)

    # --- decision -----------------------------------------------------------------------
    def prefix_hashes(self, prompt: str) -> list[int]:
        """One hash per full chunk, each covering the whole prompt up to that chunk's end, so a
        match at chunk k means the first k chunks are identical."""
        c = self.config
        n = min(len(prompt) // c.chunk_chars, c.max_chunks)
        return [hash(prompt[: (i + 1) * c.chunk_chars]) for i in range(n)]

    def matched_chunks(self, replica: str, hashes: list[int]) -> int:
        seen = self._prefixes.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def popularity(self, replica: str, hashes: list[int], matched: int) -> int:
        """How many requests routed to this replica carried the deepest matched chunk."""
        return self._prefixes[replica][hashes[matched - 1]] if matched else 0

    def work(self, replica: str, reported: Mapping[str, float]) -> float:
        return max(float(reported.get(replica, 0.0)), float(self.outstanding(replica)))

    def rank(self, prompt: str, replicas: Iterable[str],
             reported: Mapping[str, float] | None = None) -> list[str]:
        """Replicas best first: the replica holding the longest prefix of the prompt (the one
        that served it most among equals) when it is within the imbalance allowance of the
        least busy, then the rest by least work (ties at random, so idle replicas share)."""
        reported = reported or {}
        names = list(replicas)
        if not names:
            return []
        work = {r: self.work(r, reported) for r in names}
        jitter = {r: self._rng.random() for r in names}
        by_work = sorted(names, key=lambda r: (work[r], jitter[r]))
        hashes = self.prefix_hashes(prompt)
        if not hashes:
            return by_work
        matched = {r: self.matched_chunks(r, hashes) for r in names}
        # Among replicas holding the same depth, the one that served the prefix most keeps it:
        # ranking holders by work instead would spread a popular prefix evenly again as soon
        # as one request spilled over to a second replica.
        holder = max(names, key=lambda r: (matched[r], self.popularity(r, hashes, matched[r]),
                                           -work[r], jitter[r]))
        if matched[holder] == 0:
            return by_work
        least = work[by_work[0]]
        allowance = max(self.config.imbalance_tokens, self.config.imbalance_ratio * least)
        if work[holder] > least + allowance:
            return by_work
        self.prefix_preferred += 1
        return [holder] + [r for r in by_work if r != holder]
