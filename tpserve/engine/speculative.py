"""Which sequences speculate, how many tokens they may draft, and how many drafts a
verification step accepts. Plain Python: the engine core calls these around its steps.

A drafted sequence is sent as one row: its last token and the drafts (SeqStep.num_draft).
The workers return the target's greedy token at every position of that row; the drafts
that match it, in order, are accepted, plus the target's own token after them, so one
step yields 1 to num_draft + 1 tokens, exactly those greedy decoding one at a time makes."""

from __future__ import annotations

from array import array

from tpserve.config import SpeculativeConfig
from tpserve.engine.ngram import propose
from tpserve.engine.request import SamplingParams
from tpserve.engine.sequence import Sequence


def speculates(params: SamplingParams) -> bool:
    """Rows whose next token is a plain arg-max the verification can check position by
    position: greedy, no penalties (they read the history drafts would change), no grammar,
    no alternatives or prompt log-probabilities to report."""
    return (params.greedy and not params.needs_history and params.guided is None
            and not params.top_n_tokens and not params.prompt_logprobs)


def draft_budget(seq: Sequence, k: int, max_model_len: int, longrope_original: int | None
                 ) -> int:
    """The most drafts seq may verify now: a step yields up to budget + 1 tokens, which must
    stay within max_new_tokens and the model's context; a longrope sequence still rotated
    with the short factors must not feed a position past them (the scheduler recomputes it
    with the long factors once it grows past; tpserve/engine/scheduler.py)."""
    left = seq.params.max_new_tokens - len(seq.output_ids) - 1
    room = max_model_len - seq.num_input_tokens - len(seq.output_ids) - 1
    budget = min(k, left, room)
    if longrope_original is not None and not seq.long_rope:
        budget = min(budget, longrope_original - seq.num_tokens)
    return max(budget, 0)


def draft(seq: Sequence, cfg: SpeculativeConfig, budget: int, packed: array) -> list[int]:
    """Up to `budget` proposed next tokens of seq, looked up in its prompt and output.
    packed: seq's tokens as int32, kept by the caller between lookups and extended here
    (every token of seq is known when it drafts; known tokens never change)."""
    if budget < 1:
        return []
    have, p = len(packed), len(seq.prompt_ids)
    if have < p:
        packed.extend(seq.prompt_ids[have:])
        have = p
    packed.extend(seq.output_ids[have - p :])
    return propose(packed, budget, cfg.ngram_max, cfg.ngram_min)


# Lookups a sequence skips after its m-th miss in a row (a lookup that found nothing, or a
# verification that accepted nothing): 0, 1, 3, 7, 7, ... Skipped steps overlap and decode
# plainly (CUDA decode graphs included), so text that does not repeat costs little.
MAX_SKIP = 7


def skip_after(misses: int) -> int:
    return min((1 << (misses - 1)) - 1, MAX_SKIP) if misses > 0 else 0


def accepted(drafts: list[int], target: list[int]) -> int:
    """How many drafts the target agrees with, in order; target[i] is the target's token
    after the row's i-th position (its last known token, then each draft)."""
    n = 0
    for d, t in zip(drafts, target, strict=False):
        if d != t:
            break
        n += 1
    return n
