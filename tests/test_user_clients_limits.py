"""What clients meet at the edges of a real engine (tiny Llama, in-process, tp = 1): prompts
at the context limit, a one-token prompt echoed with log-probabilities, a client that leaves
mid-stream, and a burst of concurrent requests with mixed parameters that must each get its
solo answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from engine_utils import served_engine
from transformers import AutoTokenizer

MAX_LEN = 64
PROMPTS = ["The quick brown fox", "Hello world", "A", "Ray actors hold one shard"]


@pytest.fixture(scope="module")
def served(llama_dir):
    with served_engine(llama_dir, "llama", max_model_len=MAX_LEN,
                       max_concurrent_requests=32) as (backend, url):
        yield backend, url


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def _prompt_of(tok, n: int) -> str:
    """A text prompt of exactly n tokens."""
    ids = tok("x" + " 1" * MAX_LEN).input_ids[:n]
    prompt = tok.decode(ids)
    assert len(tok(prompt).input_ids) == n
    return prompt


def test_prompts_at_the_context_limit(served, tok):
    """max_model_len 64: a prompt of 63 tokens gets its one new token on both APIs; 64 is
    a 422 naming the limit (never a silent truncation); OpenAI's default max_tokens (16) on
    a 63-token prompt is a 422 naming the sum, as vLLM answers it."""
    _, url = served
    full = _prompt_of(tok, MAX_LEN - 1)
    r = httpx.post(url + "/generate", json={"inputs": full, "parameters": {
        "max_new_tokens": 1, "details": True}}, timeout=60)
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 1
    c = httpx.post(url + "/v1/completions", json={"prompt": full, "max_tokens": 1},
                   timeout=60)
    assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 1
    c = httpx.post(url + "/v1/completions", json={"prompt": full}, timeout=60)
    assert c.status_code == 422 and f"<= {MAX_LEN}" in c.json()["error"], c.text
    over = _prompt_of(tok, MAX_LEN)
    for route, body in (("/generate", {"inputs": over, "parameters": {"max_new_tokens": 1}}),
                        ("/v1/completions", {"prompt": over, "max_tokens": 1})):
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 422, r.text
        assert f"at most {MAX_LEN - 1} tokens. Given: {MAX_LEN}" in r.json()["error"]
    r = httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": MAX_LEN}}, timeout=60)
    assert r.status_code == 422 and f"max_total_tokens ({MAX_LEN})" in r.json()["error"]


@pytest.mark.parametrize("prompt", [[5], "<s>"], ids=["token-id", "special-token"])
def test_a_one_token_prompt_is_echoed_with_its_token(served, tok, prompt):
    """lm-eval scores a continuation after a context of one token: the echoed `tokens`
    start with that token (no log-probability), so they line up with `text` and
    `text_offset`. They used to leave it out."""
    _, url = served
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    first = tok.decode(prompt if isinstance(prompt, list) else tok(prompt).input_ids)
    assert lp["tokens"][0] == first and lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == 3 and lp["text_offset"][1] == len(first)
    assert choice["text"] == first + "".join(lp["tokens"][1:])


async def _settled(backend, timeout: float = 10.0) -> dict:
    """The engine's gauges once nothing runs or waits (aborts are applied between steps)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = backend.stats()
        if stats["running_sequences"] == stats["waiting_sequences"] == 0 \
                or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("route", ["/generate_stream", "/v1/completions"])
def test_a_client_leaving_mid_stream_frees_its_sequence_and_spares_the_others(served, tok,
                                                                               route):
    backend, url = served
    long = ({"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 50}}
            if route == "/generate_stream" else
            {"prompt": PROMPTS[1], "max_tokens": 50, "stream": True, "temperature": 0})
    other = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 40}}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            solo = (await client.post("/generate", json=other)).json()
            computed = backend.stats()["step_tokens"]
            neighbour = asyncio.ensure_future(client.post("/generate", json=other))
            async with client.stream("POST", route, json=long) as s:
                seen = 0
                async for line in s.aiter_lines():
                    seen += line.startswith("data:")
                    if seen == 3:
                        break  # leaves the block: the connection is closed mid-stream
            left = await _settled(backend)
            return solo, (await neighbour).json(), left, left["step_tokens"] - computed

    solo, beside, stats, computed = asyncio.run(run())
    assert beside == solo
    # The neighbour's prompt and 40 tokens, the stream's prompt and the few tokens it made
    # before the server saw the client go (run to its end: 50).
    prompts = len(tok(PROMPTS[0]).input_ids) + len(tok(PROMPTS[1]).input_ids)
    assert computed < prompts + 40 + 20, computed
    assert stats["running_sequences"] == stats["waiting_sequences"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert backend.inflight == 0


def _burst() -> list[tuple[str, dict]]:
    """24 requests over both APIs: greedy and seeded sampling, penalties (which make the
    engine wait for each step), alternatives, prompt log-probabilities, stop strings,
    streams, different lengths."""
    reqs = []
    for i in range(24):
        p = PROMPTS[i % 4]
        reqs.append([
            ("/generate", {"inputs": p, "parameters": {"max_new_tokens": 5 + i % 7,
                                                       "details": True}}),
            ("/generate", {"inputs": p, "parameters": {
                "max_new_tokens": 9, "repetition_penalty": 1.4, "top_n_tokens": 2,
                "details": True, "stop": ["o"]}}),
            ("/v1/completions", {"prompt": p, "max_tokens": 7, "temperature": 0,
                                 "frequency_penalty": 1.0, "presence_penalty": 0.5,
                                 "logprobs": 1}),
            ("/v1/completions", {"prompt": p, "max_tokens": 11, "temperature": 0.9, "seed": i,
                                 "stream": True}),
            ("/generate", {"inputs": p, "parameters": {
                "max_new_tokens": 8, "do_sample": True, "seed": i, "top_k": 20, "top_p": 0.9,
                "decoder_input_details": True, "details": True}}),
            ("/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "echo": True,
                                 "logprobs": 2, "n": 2}),
        ][i % 6])
    return reqs


async def _answer(client: httpx.AsyncClient, route: str, body: dict):
    if body.get("stream"):
        async with client.stream("POST", route, json=body) as r:
            return [json.loads(line[6:])["choices"][0]["text"] async for line in r.aiter_lines()
                    if line.startswith("data: {")]
    r = await client.post(route, json=body)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k not in ("id", "created")}


def _same(a, b) -> bool:
    """Equal answers; log-probabilities may differ in the last float bits across batches."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_burst_of_mixed_requests_gets_each_its_solo_answer(served):
    backend, url = served
    reqs = _burst()

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            solo = [await _answer(client, r, b) for r, b in reqs]
            together = await asyncio.gather(*[_answer(client, r, b) for r, b in reqs])
            return solo, together, await _settled(backend)

    solo, together, stats = asyncio.run(run())
    wrong = [i for i in range(len(reqs)) if not _same(solo[i], together[i])]
    assert not wrong, [(reqs[i], solo[i], together[i]) for i in wrong[:2]]
    assert stats["running_sequences"] == 0 and backend.inflight == 0
