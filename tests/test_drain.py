"""Shutdown inside the engine bridge: draining refuses new requests with the reason while the
one in flight carries on; stopping ends whatever is left with an error, not a silent hang."""

from __future__ import annotations

import asyncio

import pytest
from engine_utils import make_engine

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import NotReadyError


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
        with pytest.raises(NotReadyError, match="shut down before this request finished"):
            async for _ in gen:
                pass
        return first, second

    first, second = asyncio.run(run())
    assert not first.finished and not second.finished


def test_driver_stop_ends_a_stream_left_running_with_an_error_event(llama_dir, monkeypatch,
                                                                   caplog):
    """A second Ctrl-C, or --shutdown-timeout running out, with a stream in flight: the
    driver told uvicorn to exit before it stopped the engine, so uvicorn cancelled the stream
    after its 5 s grace ("Exception in ASGI application", a traceback in the log) and the
    client's connection was cut without a word. The engine is stopped first now: the stream
    ends with the error event, and nothing is cancelled or logged as a failure."""
    import json
    import threading
    import time

    import httpx
    from server_process import free_port

    from tpserve.cluster import driver as driver_module
    from tpserve.cluster import ray_metrics
    from tpserve.config import EngineConfig, ModelConfig
    from tpserve.engine.async_engine import NullMetrics

    def slow_engine(cfg):  # a step every 20 ms: the stream outlives the drain
        engine = make_engine(llama_dir, 1, local=True, max_model_len=256)
        step = engine.step
        engine.step = lambda: (time.sleep(0.02), step())[1]
        return engine

    monkeypatch.setattr(driver_module, "launch_engine", slow_engine)
    monkeypatch.setattr(ray_metrics, "EngineMetrics", lambda *a: NullMetrics())
    cfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="tiny"))
    driver = driver_module.Driver(cfg, port=free_port(), log_level="warning")
    url = driver.start()
    driver.wait_ready(120)
    lines: list[str] = []
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 200}}

    def read() -> None:
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data:"))

    reader = threading.Thread(target=read)
    reader.start()
    while not lines:
        time.sleep(0.02)
    assert driver.drain(0.0) == 1  # the time is up with the stream still running
    t0 = time.monotonic()
    driver.stop()
    reader.join(timeout=30)
    assert time.monotonic() - t0 < 4, "the stop waited out uvicorn's grace"
    last = json.loads(lines[-1][len("data:"):])
    assert last == {"error": "the server shut down before this request finished "
                    "(--shutdown-timeout ran out, or a second Ctrl-C skipped it)",
                    "error_type": "unhealthy"}  # no "internal error <id>": nothing failed
    assert "Exception in ASGI application" not in caplog.text
    assert "internal error" not in caplog.text
