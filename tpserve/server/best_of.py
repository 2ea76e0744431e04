"""`best_of`: several sampled candidates of one prompt, and the ones answered. TGI's
/generate answers one; OpenAI's /v1/completions answers `n` (server/openai.py).

The rules are TGI's (router/src/infer/mod.rs, generate_best_of): the winner has the highest
mean log-probability of its generated tokens, the first of equals wins, and the others are
kept in the order they were started (details.best_of_sequences). OpenAI's `n` best are the
first n by the same rule.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import ValidationError
from tpserve.protocol import check_max_best_of
from tpserve.server.fanout import Job, seeded


def candidate_jobs(prompt: str | list[int], params: SamplingParams, n: int) -> list[Job]:
    """n engine requests of `prompt`, each with its own seed: the request's (OpenAI allows one;
    TGI refuses it with best_of) or one random base seed, plus the candidate's index. The
    seeds always differ (the engine's own random draws could meet), and candidate i replays
    alone with the base seed + i."""
    if not params.greedy and params.seed is None:
        params = dataclasses.replace(params, seed=random.getrandbits(63))
    return [(prompt, seeded(params, i)) for i in range(n)]


def mean_logprob(events: Sequence[GenerationEvent]) -> float:
    """Mean log-probability of a candidate's generated tokens (details.tokens); NaN when a
    token has none, which never wins."""
    logprobs = [e.token.logprob for e in events]
    if not logprobs or any(lp is None for lp in logprobs):
        return math.nan
    return sum(logprobs) / len(logprobs)


def best_indices(candidates: Sequence[Sequence[GenerationEvent]], n: int) -> list[int]:
    """Indices of the n candidates answered, best first: the highest mean log-probability,
    the first of equals; a candidate without a number (NaN) ranks with -inf, below every
    number (as TGI, which starts from f32::MIN and keeps the first unless one beats it)."""

    def rank(i: int) -> tuple[float, int]:
        score = mean_logprob(candidates[i])
        return (math.inf if math.isnan(score) else -score), i

    return sorted(range(len(candidates)), key=rank)[:n]


def best_index(candidates: Sequence[Sequence[GenerationEvent]]) -> int:
    """Index of the one candidate answered (TGI's best_of)."""
    return best_indices(candidates, 1)[0]


def completion_candidates(best_of: int | None, n: int, stream: bool, greedy: bool,
                          max_best_of: int) -> int:
    """Sequences generated per prompt on OpenAI's /v1/completions: `n`, or `best_of`
    candidates of which the n best are answered. 422s: best_of < n, best_of > n with
    `stream` (as OpenAI), best_of over --max-best-of."""
    if best_of is None or best_of == n:
        return n  # nothing to rank: n choices, as without best_of
    if best_of < n:
        raise ValidationError(f"`best_of` must be >= `n` (got best_of = {best_of}, n = {n}): "
                              "the n choices are the best of best_of candidates")
    if stream:
        raise ValidationError(f"`best_of` > `n` cannot be used with `stream` (got best_of = "
                              f"{best_of}, n = {n}): the best candidates are known only when "
                              "all of them have ended")
    check_max_best_of(best_of, max_best_of)
    # Greedy decoding gives every candidate the same sequence, so any n of them are the n
    # best: only n are generated, the answer OpenAI gives at temperature 0 without the extra
    # candidates' work. TGI's 422 would break OpenAI clients that send best_of whatever the
    # temperature (OpenAI accepts it).
    return n if greedy else best_of


def best_of_each(results: Sequence[list[GenerationEvent]], per_prompt: int,
                 n: int) -> list[list[GenerationEvent]]:
    """Each prompt's n answered sequences, best first, from its `per_prompt` candidates
    (results hold them prompt after prompt)."""
    if per_prompt == n:
        return list(results)
    answered = []
    for start in range(0, len(results), per_prompt):
        group = results[start:start + per_prompt]
        answered += [group[i] for i in best_indices(group, n)]
    return answered
