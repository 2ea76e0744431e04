"""Shutdown inside the engine bridge: draining refuses new requests with the reason while the
one in flight carries on; stopping ends whatever is left with an error, not a silent hang."""

from __future__ import annotations

import asyncio

import pytest
from engine_utils import make_engine

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import GenerationError, NotReadyError


def test_drain_refuses_new_requests_and_stop_fails_the_rest(llama_dir):
    b = AsyncEngine(lambda: make_engine(llama_dir, 1, local=True, max_model_len=256),
                    "tiny", max_concurrent_requests=4)
    b.start()
    b.wait_ready(120)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)

    async def run():
        gen = b.generate("Hello world", params)
        first = await gen.__anext__()
        b.begin_drain()
        assert not b.ready() and b.not_ready_reason() == "the server is shutting down"
        with pytest.raises(NotReadyError, match="shutting down"):
            await b.generate("A", params).__anext__()
        second = await gen.__anext__()  # the request in flight still streams
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, b.stop)  # the drain time ran out
        with pytest.raises(GenerationError, match="shut down before this request finished"):
            async for _ in gen:
                pass
        return first, second

    first, second = asyncio.run(run())
    assert not first.finished and not second.finished
