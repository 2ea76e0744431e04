"""The asyncio bridge over a real engine (tp = 1 in-process): overload, abort, validation."""

from __future__ import annotations

import asyncio
import time

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


def test_rest_hands_over_every_remaining_event_at_once(backend):
    """EngineStream.rest(): what iterating gives, in one list, with the reader woken once
    (by the last event) however many tokens the engine made meanwhile."""
    from tpserve.engine import async_engine

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    wakes = []
    real = async_engine.EventSink.put_nowait

    def counting(self, item):
        waiter = self._waiter
        real(self, item)
        if waiter is not None and waiter.done():
            wakes.append(item)

    async def run():
        iterated = [ev async for ev in backend.generate("Hello world", params)]
        stream = backend.generate("Hello world", params)
        first = await stream.__anext__()
        wakes.clear()
        rest = await stream.rest()
        more = await stream.rest()
        await stream.aclose()
        return iterated, [first] + rest, more

    async_engine.EventSink.put_nowait = counting
    try:
        iterated, whole, more = asyncio.run(run())
    finally:
        async_engine.EventSink.put_nowait = real
    assert [e.token.id for e in whole] == [e.token.id for e in iterated]
    assert whole[-1].finished and not any(e.finished for e in whole[:-1]) and more == []
    assert len(wakes) == 1 and wakes[0].finished
    assert backend.inflight == 0 and not backend.engine.has_work()


def test_a_stream_dropped_without_closing_gives_its_place_back(backend):
    import gc

    async def run():
        stream = backend.generate("Hello world", SamplingParams(max_new_tokens=100,
                                                                ignore_eos=True))
        await stream.__anext__()
        assert backend.inflight == 1
        del stream
        gc.collect()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not backend.engine.has_work():
                break

    asyncio.run(run())
    assert backend.inflight == 0 and not backend.engine.has_work()
    assert backend.engine.scheduler.blocks.num_free == backend.engine.num_blocks


def test_validation_errors_from_rest_leave_nothing_queued(backend):
    async def run():
        return await backend.generate("Hello", SamplingParams(max_new_tokens=200)).rest()

    with pytest.raises(ValidationError, match="must be <= 128"):
        asyncio.run(run())
    assert backend.inflight == 0 and not backend.engine.has_work()


def test_non_streamed_answers_over_http_time_out_and_free_the_engine(backend):
    """The app's non-streamed path collects with rest(): the request timeout still cuts it
    (504) and aborts the request, and an answer within the limit is whole."""
    import httpx
    from fake_backend import serve

    from tpserve.config import ServerConfig
    from tpserve.server.app import build_app

    with serve(build_app(backend, ServerConfig(request_timeout_s=0.3))) as url:
        ok = httpx.post(url + "/generate", json={"inputs": "Hello world", "parameters": {
            "max_new_tokens": 4, "details": True}}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert ok.json()["details"]["generated_tokens"] == 4
        assert len(ok.json()["details"]["tokens"]) == 4
        real_step = backend.engine.step

        def paced():  # the tiny model steps fast: 100 tokens take 2 s this way
            time.sleep(0.02)
            return real_step()

        backend.engine.step = paced
        try:
            r = httpx.post(url + "/generate", json={"inputs": "Hello world", "parameters": {
                "max_new_tokens": 100}}, timeout=30)
        finally:
            backend.engine.step = real_step
        assert r.status_code == 504, r.text
        assert r.json()["error_type"] == "timeout"
    for _ in range(100):
        if backend.inflight == 0 and not backend.engine.has_work():
            break
        time.sleep(0.02)
    assert backend.inflight == 0 and not backend.engine.has_work()


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(backend):
    """A Python API user whose loop ended (asyncio.run once per request) while its stream was
    still producing: the engine thread used to die on the closed loop (call_soon_threadsafe
    raises), so nothing was served after it. Now that request is aborted and others run."""
    loop = asyncio.new_event_loop()
    gen = backend.generate("Hello world", SamplingParams(max_new_tokens=100, ignore_eos=True))
    loop.run_until_complete(gen.__anext__())
    loop.close()  # `gen` is still referenced: no abort from its finalizer
    for _ in range(200):  # the next step's events find the closed loop
        time.sleep(0.02)
        if not backend.engine.has_work():
            break
    assert not backend.engine.has_work()  # the orphaned request was aborted
    events = asyncio.run(asyncio.wait_for(_collect(backend, "The quick", 4), 60))
    assert len(events) == 4 and events[-1].finished
    del gen
