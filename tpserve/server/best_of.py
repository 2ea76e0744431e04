"""TGI's `best_of`: several sampled candidates of one prompt, and the one answered.

The rules are TGI's (router/src/infer/mod.rs, generate_best_of): the winner has the highest
mean log-probability of its generated tokens, the first of equals wins, and the others are
kept in the order they were started (details.best_of_sequences).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.server.fanout import Job, seeded


def candidate_jobs(prompt: str, params: SamplingParams, n: int) -> list[Job]:
    """n engine requests of `prompt`, each with its own seed. One random base seed plus the
    candidate's index: the seeds always differ (the engine's own random draws could meet),
    and each reported seed replays its candidate alone."""
    if not params.greedy:
        params = dataclasses.replace(params, seed=random.getrandbits(63))
    return [(prompt, seeded(params, i)) for i in range(n)]


def mean_logprob(events: Sequence[GenerationEvent]) -> float:
    """Mean log-probability of a candidate's generated tokens (details.tokens); NaN when a
    token has none, which never wins."""
    logprobs = [e.token.logprob for e in events]
    if not logprobs or any(lp is None for lp in logprobs):
        return math.nan
    return sum(logprobs) / len(logprobs)


def best_index(candidates: Sequence[Sequence[GenerationEvent]]) -> int:
    """Index of the candidate answered: the highest mean log-probability, the first of
    equals; the first when none has a number (as TGI, which starts from f32::MIN)."""
    best, best_score = 0, -math.inf
    for i, events in enumerate(candidates):
        score = mean_logprob(events)
        if score > best_score:
            best, best_score = i, score
    return best
