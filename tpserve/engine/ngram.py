"""Speculative decoding by prompt lookup: draft the next tokens of a sequence by finding its
last few tokens earlier in its own prompt and output, and proposing what followed there.

Pure Python, no model: text that quotes its context (code edits, retrieval answers,
summaries) repeats long runs of it, and one forward pass then verifies several drafted
tokens at once (EngineCore, tpserve/engine/speculative.py). The search is a C-level
substring search over the tokens packed as int32 (an array the caller may keep and extend
between lookups), so a lookup in a context of thousands of tokens costs microseconds, not
a Python loop over every token."""

from __future__ import annotations

from array import array

_WIDTH = 4  # bytes per token id in the packed form (int32)


def propose(tokens: list[int] | array, k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` of ngram_max down to ngram_min tokens; [] when no such suffix recurs. A
    match that ends p tokens before the end is a loop of period p: what follows the end of
    `tokens` is taken to repeat it."""
    n = len(tokens)
    if k < 1 or n < ngram_min + 1:
        return []
    if not isinstance(tokens, array):
        tokens = array("i", tokens)
    packed = tokens.tobytes()
    for size in range(min(ngram_max, n - 1), ngram_min - 1, -1):
        end = _rfind(packed, packed[(n - size) * _WIDTH :], (n - 1) * _WIDTH)
        if end >= 0:
            return _follow(tokens, end, k)
    return []


def _rfind(packed: bytes, pattern: bytes, limit: int) -> int:
    """The last token index of the most recent token-aligned occurrence of pattern inside
    packed[:limit], or -1."""
    while True:
        at = packed.rfind(pattern, 0, limit)
        if at < 0:
            return -1
        if at % _WIDTH == 0:
            return at // _WIDTH + len(pattern) // _WIDTH - 1
        limit = at + len(pattern) - 1  # a match across token boundaries: look further back


def _follow(tokens: array, end: int, k: int) -> list[int]:
    out = tokens[end + 1 : end + 1 + k].tolist()
    period = len(tokens) - 1 - end
    for i in range(len(out), k):
        out.append(out[i - period])
    return out
