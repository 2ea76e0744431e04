"""OpenAI requests that open several generations at once (`n` > 1, a list of prompts) through
the Serve ingress (`--replicas` > 1).

Serve's router keys the requests it is placing by the internal request id that a handle call
takes from the ingress request's context, and drops a second pending request with an id it
already holds (its retry path): two calls made side by side for one HTTP request shared that
id, and the request hung."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from serve_fakes import FakeHandle, FakeReplica

from tpserve.engine.request import SamplingParams
from tpserve.serve.ingress import ReplicaSetBackend

serve_context = pytest.importorskip("ray.serve.context")


class IdRecordingHandle(FakeHandle):
    """A FakeHandle that notes the Serve request context each generate call is made in, as
    a DeploymentHandle reads it in .remote() (ray/serve/_private/default_impl.py)."""

    def __init__(self, replicas) -> None:
        super().__init__(replicas)
        self.internal_ids: list[str] = []

    def options(self, **kw):
        handle = super().options(**kw)
        outer = self

        class Recording:
            def __getattr__(self, name):
                method = getattr(handle, name)
                if name != "generate":
                    return method

                class Remote:
                    @staticmethod
                    def remote(*args):
                        ctx = serve_context._get_serve_request_context()
                        outer.internal_ids.append(ctx._internal_request_id)
                        return method.remote(*args)

                return Remote()

        return Recording()


def test_side_by_side_generations_of_one_request_get_their_own_serve_request_ids():
    handle = IdRecordingHandle([FakeReplica("r0"), FakeReplica("r1")])
    backend = ReplicaSetBackend(handle, tokenizer=None)  # generate() does not tokenize
    asyncio.run(backend.refresh_info())

    async def one_http_request():
        # What Serve sets for the ingress request before the route runs.
        serve_context._set_request_context(request_id="req-1", _internal_request_id="int-1")
        params = SamplingParams(max_new_tokens=2)

        async def first_event():
            return await anext(backend.generate("a b", params))

        # OpenAIRoutes._open_all opens a request's generations as tasks side by side.
        await asyncio.gather(*[asyncio.ensure_future(first_event()) for _ in range(3)])
        return serve_context._get_serve_request_context()

    after = asyncio.run(one_http_request())
    assert len(handle.internal_ids) == 3
    assert len(set(handle.internal_ids)) == 3, handle.internal_ids
    # The ingress request keeps its own ids (Serve's logs and cancellation use them).
    assert (after.request_id, after._internal_request_id) == ("req-1", "int-1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settled_tokens(url: str) -> float:
    """Tokens the replicas generated so far, once none runs anything (their stats are polled
    about once a second)."""
    last = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reps = httpx.get(url + "/info", timeout=10).json()["replicas"]
        busy = any(r.get("running_sequences", 0) or r.get("waiting_sequences", 0) for r in reps)
        total = sum(r.get("tokens_generated", 0.0) for r in reps)
        if not busy and total == last:
            return total
        last = None if busy else total
        time.sleep(1.2)
    raise AssertionError(f"replicas still busy: {reps}")


@pytest.mark.slow
def test_n_choices_and_prompt_lists_are_answered_through_serve(ray_cluster, llama_dir):
    """The real Serve ingress and router, 2 replicas of tp = 1: `n` = 2 and two prompts
    answer (they hung), greedy choices equal transformers'."""
    from tiny_models import hf_greedy
    from transformers import AutoTokenizer

    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.serve import app

    cfg = EngineConfig(
        model=ModelConfig(path=str(llama_dir), model_id="tiny", max_model_len=256),
        parallel=ParallelConfig(tp_size=1, device="cpu", cpus_per_shard=1),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_concurrent_requests=16))
    spec = app.ReplicaSpec(num_replicas=2, shard_cpus=0.5, health_check_period_s=1.0)
    url = app.run(cfg, spec, "127.0.0.1", _free_port())
    try:
        prompts = ["The quick brown fox", "Hello world"]
        tok = AutoTokenizer.from_pretrained(llama_dir)
        want = [tok.decode(i, skip_special_tokens=True) for i in hf_greedy(llama_dir, prompts, 6)]
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompts[0], "max_tokens": 6, "temperature": 0, "n": 2})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [want[0], want[0]]
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == want
        # A client that leaves stops its choices on the replicas (the ingress cancels them):
        # far fewer than the 2 x 2 x 240 tokens asked for are generated.
        before = _settled_tokens(url)
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 240, "n": 2}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as resp:
            next(resp.iter_lines())  # the first chunk, then leave
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.2)
        # The replicas' gauges are those of their last step: steps of another request
        # refresh them (an aborted request's last gauges still say it runs).
        for _ in range(2):
            httpx.post(url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": prompts[1], "max_tokens": 1})
        assert _settled_tokens(url) - before < 2 * 240
    finally:
        app.shutdown()
