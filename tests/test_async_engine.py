"""The asyncio bridge over a real engine (tp = 1 in-process): overload, abort, validation."""

from __future__ import annotations

import asyncio

import pytest
from engine_utils import make_engine

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import OverloadedError, ValidationError


@pytest.fixture(scope="module")
def backend(llama_dir):
    b = AsyncEngine(lambda: make_engine(llama_dir, 1, local=True, max_model_len=128),
                    "tiny", max_concurrent_requests=2)
    b.start()
    b.wait_ready(120)
    yield b
    b.stop()


async def _collect(backend, prompt, n):
    return [ev async for ev in backend.generate(prompt, SamplingParams(max_new_tokens=n,
                                                                       ignore_eos=True))]


def test_generates_and_reports_final_event(backend):
    events = asyncio.run(_collect(backend, "Hello world", 5))
    assert len(events) == 5 and events[-1].finished and events[-1].finish_reason == "length"
    assert backend.engine.scheduler.blocks.num_free == backend.engine.num_blocks


def test_overload_gets_overloaded_error_and_others_finish(backend):
    async def run():
        a = asyncio.create_task(_collect(backend, "Hello world", 100))
        b = asyncio.create_task(_collect(backend, "The quick", 100))
        while backend.inflight < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(OverloadedError, match="limit is 2"):
            await _collect(backend, "one too many", 3)
        return await a, await b

    a, b = asyncio.run(run())
    assert len(a) == 100 and len(b) == 100


def test_closing_the_stream_early_aborts_the_request(backend):
    async def run():
        gen = backend.generate("Hello world", SamplingParams(max_new_tokens=100,
                                                             ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()
        for _ in range(100):  # the engine thread drains the abort between steps
            await asyncio.sleep(0.02)
            if not backend.engine.has_work():
                break
        return first

    first = asyncio.run(run())
    assert not first.finished
    assert not backend.engine.has_work() and backend.inflight == 0
    assert backend.engine.scheduler.blocks.num_free == backend.engine.num_blocks


def test_too_long_prompt_is_a_validation_error_and_nothing_is_queued(backend):
    with pytest.raises(ValidationError, match="at most 127 tokens"):
        asyncio.run(_collect(backend, "hello " * 60, 1))
    with pytest.raises(ValidationError, match="must be <= 128"):
        asyncio.run(_collect(backend, "Hello", 200))
    assert not backend.engine.has_work() and backend.inflight == 0
    assert len(asyncio.run(_collect(backend, "Hello", 3))) == 3
