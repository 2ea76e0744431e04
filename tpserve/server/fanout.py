"""Several engine requests for one HTTP request: OpenAI's `n` choices per prompt and TGI's
`best_of` candidates. Each is its own engine stream with its own seed, all started side by
side (so they share prefill steps) and counted against --max-concurrent-requests."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import SamplingParams
from tpserve.errors import ValidationError
from tpserve.fields import U64_MAX
from tpserve.server.backend import EngineBackend
from tpserve.server.metrics import Metrics, TrackedStream

# (prompt, its sampling parameters): one engine request
Job = tuple[str | list[int], SamplingParams]


def seeded(params: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a seeded request: its own seed, so the sequences differ and each
    repeats (the sampler hashes the seed, so neighbouring seeds draw unrelated numbers)."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (U64_MAX + 1))


def check_fanout(total: int, asks: str, unit: str, info: ModelInfo) -> None:
    """A request whose `total` sequences could never run at once is refused (422), not left
    to wait on itself: `asks` says which fields multiplied up to it, `unit` what they are."""
    if total > info.max_concurrent_requests:
        raise ValidationError(
            f"{asks} asks for {total} {unit}, more than this server runs at once "
            f"({info.max_concurrent_requests}, --max-concurrent-requests): send fewer per "
            "request")


async def open_all(metrics: Metrics, backend: EngineBackend, jobs: Sequence[Job],
                   truncate: int | None = None,
                   add_special_tokens: bool = True) -> list[TrackedStream]:
    """Every job's engine stream, started side by side; if one is refused, the others are
    closed and its error is raised."""
    tasks = [asyncio.ensure_future(metrics.open_stream(
        backend, prompt, params, truncate=truncate, add_special_tokens=add_special_tokens))
        for prompt, params in jobs]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # cancelled (the client left) while they were starting
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        raise
    failed = [t.exception() for t in tasks if t.exception() is not None]
    opened = [t.result() for t in tasks if t.exception() is None]
    if failed:
        for tracked in opened:
            await tracked.aclose()
        raise failed[0]
    return opened
