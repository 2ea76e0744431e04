"""Speculative decoding by prompt lookup: draft the next tokens of a sequence by finding its
last few tokens earlier in its own prompt and output, and proposing what followed there.

Pure Python, no model: text that quotes its context (code edits, retrieval answers,
summaries) repeats long runs of it, and one forward pass then verifies several drafted
tokens at once (EngineCore, tpserve/engine/speculative.py)."""

from __future__ import annotations


def propose(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` of ngram_max down to ngram_min tokens; [] when no such suffix recurs. A
    match that ends p tokens before the end is a loop of period p: what follows the end of
    `tokens` is taken to repeat it."""
    n = len(tokens)
    if k < 1 or n < ngram_min + 1:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    # Scan candidate ends j (tokens[j] == last) from the most recent back: the first j whose
    # match reaches ngram_max wins at once; else the most recent longest match does.
    for j in range(n - 2, -1, -1):
        if tokens[j] != last:
            continue
        m = 1
        while m < ngram_max and m <= j and tokens[j - m] == tokens[n - 1 - m]:
            m += 1
        if m > best_len:
            best_len, best_end = m, j
            if m >= ngram_max:
                break
    if best_len < ngram_min:
        return []
    out = tokens[best_end + 1 : best_end + 1 + k]
    period = n - 1 - best_end
    for i in range(len(out), k):
        out.append(out[i - period])
    return out
