"""A busy server's lifecycle against `tpserve launch` on the embedded default model (it has
a chat template): a storm of mixed requests (TGI and OpenAI, streamed or not, n > 1, stop
strings, logprobs, seeds, guided JSON) with a third cut by their clients; a burst past
--max-concurrent-requests; pathological inputs mixed in. Afterwards nothing is left
running, waiting or holding KV blocks, and greedy answers still equal transformers'."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import pytest
from server_process import launched
from tiny_models import hf_greedy
from transformers import AutoTokenizer

import tpserve

MODEL = Path(tpserve.__file__).parent / "default_model"
LIMIT = 16  # --max-concurrent-requests
PROMPTS = ["The quick brown fox", "Once upon a time", "In 1905,", "x" + " x" * 120]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# 80 blocks of 16 tokens: one request of the whole context (1024) fits, the storm preempts.
ARGS = ["--model", str(MODEL), "--num-blocks", "80", "--prefix-caching",
        "--max-concurrent-requests", str(LIMIT), "--request-timeout", "120"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with launched(ARGS, tmp_path_factory.mktemp("soak") / "server.log") as u:
        yield u


@pytest.fixture(scope="module")
def oracle():
    """transformers' greedy text for PROMPTS[0] and PROMPTS[1], 12 tokens (float32, CPU)."""
    tok = AutoTokenizer.from_pretrained(MODEL)
    return {p: tok.decode(ids, skip_special_tokens=True)
            for p, ids in zip(PROMPTS[:2], hf_greedy(MODEL, PROMPTS[:2], 12), strict=True)}


def engine_stats(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    stats = dict(re.findall(r'^tpserve_engine\{stat="(\w+)"\} (\S+)$', text, re.MULTILINE))
    inflight = re.search(r"^tpserve_requests_inflight (\S+)$", text, re.MULTILINE).group(1)
    return {**{k: float(v) for k, v in stats.items()}, "http_inflight": float(inflight)}


def wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        s = engine_stats(url)
        if (s["running_sequences"] == s["waiting_sequences"] == 0
                and s["requests_inflight"] == s["http_inflight"] == 0
                and s["kv_blocks_free"] == s["kv_blocks_total"] == 80):
            return s
        assert time.monotonic() < deadline, f"not idle {timeout}s after the load: {s}"
        time.sleep(0.2)


def greedy_text(url: str, prompt: str) -> str:
    r = httpx.post(url + "/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 12, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def mixed_request(rng: random.Random) -> tuple[str, dict, bool]:
    kind = rng.choice(["tgi", "tgi_stream", "cmpl", "cmpl_stream", "chat", "chat_stream"])
    prompt, most = rng.choice(PROMPTS), rng.choice([1, 8, 32])
    stream = kind.endswith("stream")
    if kind.startswith("tgi"):
        params: dict = {"max_new_tokens": most, "details": True}
        if rng.random() < 0.5:
            params.update(do_sample=True, temperature=0.9, seed=rng.randrange(100))
        if rng.random() < 0.3:
            params["stop"] = [rng.choice(["e", " the", "x" * 500])]
        if rng.random() < 0.2:
            params["grammar"] = {"type": "json", "value": SCHEMA}
        if rng.random() < 0.3:
            params["top_n_tokens"] = 2
        return ("/generate_stream" if stream else "/generate",
                {"inputs": prompt, "parameters": params}, stream)
    body: dict = {"max_tokens": most, "temperature": rng.choice([0.0, 0.8]), "stream": stream}
    if rng.random() < 0.4:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(100)
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["e", " the", "y" * 500])]
    if rng.random() < 0.2:
        body["response_format"] = {"type": "json_object"}
    if kind.startswith("chat"):
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=2)
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": prompt}]}, stream
    if rng.random() < 0.3:
        body["logprobs"] = 2
    return "/v1/completions", {**body, "prompt": prompt}, stream


async def one(client: httpx.AsyncClient, rng: random.Random) -> str:
    """One request's outcome: completed, cut (by us), http_429, or anything else (a
    failure). A third are cut: streams after a few events, others by a short timeout."""
    route, body, stream = mixed_request(rng)
    cut = rng.random() < 1 / 3
    try:
        async with asyncio.timeout(90):
            if not stream:
                try:
                    r = await client.post(route, json=body,
                                          timeout=rng.uniform(0.02, 0.5) if cut else 90)
                except httpx.TimeoutException:
                    return "cut"
                return "completed" if r.status_code == 200 else f"http_{r.status_code}"
            async with client.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"http_{r.status_code}"
                events, stop_at = 0, rng.randrange(1, 6)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return "completed"
                    data = json.loads(payload)
                    if "error" in data:
                        return f"error_{data['error_type']}"
                    events += 1
                    if cut and events >= stop_at:
                        return "cut"  # leaving the block closes the connection
                    if data.get("generated_text") is not None:
                        return "completed"  # TGI's last event
                return "truncated"
    except TimeoutError:
        return "hung"


async def storm(url: str, requests: int, concurrency: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=90,
                                 limits=httpx.Limits(max_connections=2 * concurrency)) as c:
        async def gated(r: random.Random) -> str:
            async with gate:
                return await one(c, r)
        return await asyncio.gather(*(gated(random.Random(rng.random()))
                                      for _ in range(requests)))


def test_storm_with_cut_clients_leaves_nothing_behind(url, oracle):
    assert greedy_text(url, PROMPTS[0]) == oracle[PROMPTS[0]]
    outcomes = asyncio.run(storm(url, requests=90, concurrency=6, seed=1))
    assert set(outcomes) <= {"completed", "cut", "http_429"}, outcomes
    print("STORM", {o: outcomes.count(o) for o in set(outcomes)})
    assert outcomes.count("completed") > 30 and outcomes.count("cut") > 10, outcomes
    wait_idle(url)
    # Preemption, prefix caching and aborted neighbours left no trace in later answers.
    for prompt in PROMPTS[:2]:
        assert greedy_text(url, prompt) == oracle[prompt]


def test_burst_past_the_limit_is_429_with_retry_after_and_the_rest_complete(url, oracle):
    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=90,
                                     limits=httpx.Limits(max_connections=4 * LIMIT)) as c:
            return await asyncio.gather(*(c.post("/generate", json={
                "inputs": PROMPTS[1], "parameters": {"max_new_tokens": 12, "ignore_eos": True}})
                for _ in range(4 * LIMIT)))

    rs = asyncio.run(burst())
    refused = [r for r in rs if r.status_code == 429]
    done = [r for r in rs if r.status_code == 200]
    assert len(refused) + len(done) == len(rs), [r.text for r in rs]
    assert refused and len(done) >= LIMIT, (len(refused), len(done))
    assert all(r.headers.get("retry-after") == "1" and r.json()["error_type"] == "overloaded"
               for r in refused)
    assert {r.json()["generated_text"] for r in done} == {oracle[PROMPTS[1]]}
    wait_idle(url)


def test_pathological_inputs_are_422_or_answered_while_others_are_served(url, oracle):
    tokens = len(httpx.post(url + "/tokenize", json={"inputs": "x"}).json())
    assert tokens == 1 and len(httpx.post(url + "/tokenize", json={"inputs": "x x"}).json()) == 2
    at_limit = "x" + " x" * 1022  # 1023 tokens: the longest prompt, one token to generate
    unicode = ("héllo wörld 😀 日本語 " * 600)[:10_000]
    cases = [  # (route, body, expected status)
        ("/generate", {"inputs": at_limit, "parameters": {"max_new_tokens": 1}}, 200),
        ("/v1/completions", {"prompt": at_limit, "max_tokens": 1}, 200),
        ("/generate", {"inputs": at_limit + " x", "parameters": {"max_new_tokens": 1}}, 422),
        ("/generate", {"inputs": at_limit, "parameters": {"max_new_tokens": 2}}, 422),
        ("/generate", {"inputs": "", "parameters": {"max_new_tokens": 1}}, 422),
        ("/generate_stream", {"inputs": "", "parameters": {"max_new_tokens": 1}}, 422),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, 422),
        ("/generate", {"inputs": "<s></s><unk><pad>" * 4, "parameters": {"max_new_tokens": 4}},
         200),
        ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 4,
                                                      "stop": ["z" * 100_000]}}, 422),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": ["z" * 100_000]}, 422),
        ("/generate", {"inputs": unicode, "parameters": {"max_new_tokens": 4}}, 422),
        ("/generate", {"inputs": unicode, "parameters": {"max_new_tokens": 4,
                                                         "truncate": 200}}, 200),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": unicode}],
                                  "max_tokens": 4}, 422),
    ]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=90) as c:
            normal = [c.post("/generate", json={"inputs": PROMPTS[0], "parameters": {
                "max_new_tokens": 12, "ignore_eos": True}}) for _ in range(6)]
            odd = [c.post(route, json=body) for route, body, _ in cases]
            return await asyncio.gather(*odd), await asyncio.gather(*normal)

    odd, normal = asyncio.run(run())
    for (route, body, status), r in zip(cases, odd, strict=True):
        assert r.status_code == status, (route, str(body)[:80], r.status_code, r.text[:300])
        if status == 422:
            assert r.json()["error_type"] == "validation" and r.json()["error"], r.text
    assert odd[0].json()["generated_text"] and odd[1].json()["usage"]["total_tokens"] == 1024
    assert [r.json()["generated_text"] for r in normal] == [oracle[PROMPTS[0]]] * 6
    wait_idle(url)
