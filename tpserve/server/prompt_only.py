"""`max_tokens: 0` with `echo` on /v1/completions: the prompt back (with its log-probabilities
when `logprobs` is set) and nothing generated, as OpenAI answers it (lm-eval's scoring
requests send it). The engine samples at least one token after a prompt, so such a request
runs for one greedy token, which these streams drop: the answer reads as if it stopped at
the length limit before its first token."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo
from tpserve.server.metrics import TrackedStream


def prompt_only_params(params: SamplingParams) -> SamplingParams:
    """The engine request of a max_tokens 0 answer: one token, the cheapest to choose."""
    return dataclasses.replace(params, max_new_tokens=1, do_sample=False, temperature=None,
                               top_p=None, guided=None)


def nothing_generated(final: GenerationEvent) -> GenerationEvent:
    """The final event with its token dropped: no text, no token counted, ended by length.
    The token is marked special, so the log-probabilities and the stream skip it."""
    return dataclasses.replace(final, token=TokenInfo(final.token.id, "", None, special=True),
                               top_tokens=None, generated_text="", generated_tokens=0,
                               finish_reason="length")


class PromptOnly:
    """A started max_tokens 0 request: a TrackedStream whose one generated token is dropped
    (iterate for its final event, `collect()`, always `aclose()`)."""

    def __init__(self, tracked: TrackedStream) -> None:
        self._tracked = tracked
        tracked.counts_tokens = False  # the one token is dropped, never sent

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[GenerationEvent]:
        async for event in self._tracked:
            if event.finished:
                yield nothing_generated(event)

    async def collect(self) -> list[GenerationEvent]:
        return [nothing_generated((await self._tracked.collect())[-1])]

    async def aclose(self) -> None:
        await self._tracked.aclose()
