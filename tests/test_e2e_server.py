"""`tpserve launch --tp 2` in a subprocess, talked to by tpserve.Client and TGI's own client."""

from __future__ import annotations

import ipaddress
import re
import time
from pathlib import Path

import httpx
import pytest
from server_process import launched_process, listening_sockets
from tiny_models import hf_greedy
from transformers import AutoTokenizer

import tpserve

PROMPTS = ["The quick brown fox", "Hello world, this is"]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("logs") / "server.log"


@pytest.fixture(scope="module")
def launcher(llama_dir, server_log):
    """(the `tpserve launch` process, its URL)."""
    # Info level: test_ready_line_splits_the_start_up reads the ready lines.
    with launched_process(["--model", str(llama_dir), "--tp", "2", "--num-blocks", "512",
                           "--log-level", "info"], server_log) as (proc, url):
        yield proc, url


@pytest.fixture(scope="module")
def server(launcher):
    return launcher[1]


def test_ready_line_splits_the_start_up(server, server_log):
    """Where the launch's time went, one phase each, adding up to the ready time."""
    deadline = time.monotonic() + 30  # /health turns 200 just before the line is logged
    while "start-up:" not in (log := server_log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    ready = float(re.search(r"ready ([0-9.]+)s after launch", log).group(1))
    line = re.search(r"start-up: (.*)", log).group(1)
    split = {name: float(sec) for name, sec in re.findall(r"([A-Za-z][A-Za-z ]*?) ([0-9.]+)s",
                                                          line)}
    for phase in ("checks", "ray", "driver", "imports", "device", "weights", "KV cache",
                  "kernel warmup", "step loop"):
        assert phase in split, (phase, line)
    assert 0.5 * ready <= sum(split.values()) <= ready + 0.5, (ready, line)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_local_cluster_listens_on_loopback_only(launcher):
    """The cluster `tpserve launch` starts is on this machine alone: none of its processes
    (GCS, raylet, agents, the driver and the shards, their process group) listens on an
    address that another machine reaches. Ray bound all but the dashboard to every
    interface, and so did torch's rendezvous store on rank 0."""
    from test_rebuild_server import descendants

    proc, url = launcher
    port = int(url.rsplit(":", 1)[1])
    pids = [proc.pid, *descendants(proc.pid)]
    found = listening_sockets(pids)
    titles = {pid: " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
              .strip()[:120] for _, _, pid in found}
    # Not vacuous: the HTTP server, the GCS and both shards were seen listening.
    assert ("127.0.0.1", port) in {(a, p) for a, p, _ in found}, found
    assert any(t.split()[0].endswith("gcs_server") for t in titles.values()), titles
    assert {"ray::EngineCoreActor", "ray::FollowerActor"} <= {
        t.split(".")[0] for t in titles.values()}, titles
    exposed = [f"{a} port {p}: {titles[pid]}" for a, p, pid in found
               if not ipaddress.ip_address(a).is_loopback]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)


@pytest.fixture(scope="module")
def expected(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = hf_greedy(llama_dir, PROMPTS, 16)
    return [tok.decode(i, skip_special_tokens=True) for i in ids], ids


def test_clients_match_transformers(server, expected):
    from text_generation import Client as TGIClient

    texts, ids = expected
    ours, tgi = tpserve.Client(server, timeout=60), TGIClient(server, timeout=60)
    for prompt, text, tok_ids in zip(PROMPTS, texts, ids, strict=True):
        r = ours.generate(prompt, max_new_tokens=16)
        assert r.generated_text == text
        assert [t.id for t in r.details.tokens] == tok_ids
        assert r.details.generated_tokens == 16
        assert r.details.finish_reason == "length"
        assert all(t.logprob is not None and t.logprob <= 0 for t in r.details.tokens)
        t = tgi.generate(prompt, max_new_tokens=16)
        assert t.generated_text == text
        assert [x.id for x in t.details.tokens] == tok_ids


def test_stream_concatenates_to_final_text(server, expected):
    from text_generation import Client as TGIClient

    texts, _ = expected
    for client in (tpserve.Client(server, timeout=60), TGIClient(server, timeout=60)):
        events = list(client.generate_stream(PROMPTS[0], max_new_tokens=16))
        assert len(events) == 16
        assert events[-1].generated_text == texts[0]
        assert "".join(e.token.text for e in events if not e.token.special) == texts[0]
        assert all(e.generated_text is None for e in events[:-1])


def test_bad_request_gets_422_and_server_keeps_serving(server, expected):
    from text_generation import Client as TGIClient
    from text_generation.errors import ValidationError as TGIValidationError

    r = httpx.post(server + "/generate", json={"inputs": "hi", "parameters": {"top_p": 3}})
    assert r.status_code == 422
    body = r.json()
    assert body["error_type"] == "validation" and "top_p" in body["error"]
    r = httpx.post(server + "/generate", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    # Too long for the model: the engine's own length check, through TGI's client.
    with pytest.raises(TGIValidationError):
        TGIClient(server, timeout=60).generate("hello " * 400, max_new_tokens=400)
    with pytest.raises(tpserve.errors.ValidationError):
        tpserve.Client(server, timeout=60).generate("hello " * 400, max_new_tokens=400)
    # Still serving, with the same answer.
    assert tpserve.Client(server, timeout=60).generate(
        PROMPTS[1], max_new_tokens=16).generated_text == expected[0][1]


def test_concurrent_requests_batch_and_match(server, expected):
    import asyncio

    texts, _ = expected

    async def run():
        client = tpserve.AsyncClient(server, timeout=120)
        return await asyncio.gather(*[client.generate(p, max_new_tokens=16)
                                      for p in PROMPTS * 3])

    results = asyncio.run(run())
    assert [r.generated_text for r in results] == texts * 3


def test_health_and_info(server):
    assert httpx.get(server + "/health").status_code == 200
    info = httpx.get(server + "/info").json()
    assert info["tp_size"] == 2 and info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == 512
    text = httpx.get(server + "/metrics").text
    assert 'tpserve_engine{stat="kv_blocks_total"} 512.0' in text
    assert 'tpserve_engine{stat="ready"} 1.0' in text
    assert "tpserve_http_requests_total" in text


def test_openai_client_completions_and_chat(server, expected, llama_dir):
    import openai

    texts, _ = expected
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list().data]
    c = client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=16,
                                  temperature=0)
    assert c.choices[0].text == texts[0]
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 16
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model="any", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)]
    assert "".join(pieces) == texts[0]
    # The tiny tokenizer has no chat template: a clear 422, not a crash.
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="any", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    body = info.value.response.json()
    assert "chat template" in body["error"] and body["error_type"] == "validation"


def test_openai_choices_and_echoed_logprobs_match_transformers(server, expected, llama_dir):
    """Several prompts x n greedy choices at tp = 2, and what lm-eval's log-likelihood
    requests send (token ids, echo, logprobs) and read: the echoed prompt's token
    log-probabilities and their alternatives."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    texts, _ = expected
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    c = client.completions.create(model="any", prompt=PROMPTS, n=2, max_tokens=16,
                                  temperature=0)
    assert [ch.text for ch in c.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert c.usage.completion_tokens == 64
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    # as lm-eval sends it: the prompt as token ids, echoed, one new token, 1+ alternatives
    e = client.completions.create(model="any", prompt=ids[0].tolist(), max_tokens=1,
                                  temperature=0, echo=True, logprobs=2)
    by_text = client.completions.create(model="any", prompt=PROMPTS[1], max_tokens=1,
                                        temperature=0, echo=True, logprobs=2)
    assert by_text.choices[0].logprobs.tokens == e.choices[0].logprobs.tokens
    lp = e.choices[0].logprobs
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)
    n = ids.shape[1]
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None
    want = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), want, rtol=1e-4,
                               atol=1e-4)
    best = logp[:-1].max(-1).values
    for i in range(1, n):  # the likeliest alternative's log p, and the token itself
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(best[i - 1]), abs=1e-4)
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])


def test_load_mixed_streams_lose_nothing(server, expected):
    """48 concurrent requests, half streamed: every one completes with the greedy text."""
    import asyncio

    texts, _ = expected

    async def one(client, i):
        prompt = PROMPTS[i % 2]
        if i % 4 < 2:
            return prompt, (await client.generate(prompt, max_new_tokens=16)).generated_text
        events = [e async for e in client.generate_stream(prompt, max_new_tokens=16)]
        return prompt, events[-1].generated_text

    async def run():
        client = tpserve.AsyncClient(server, timeout=300)
        return await asyncio.gather(*[one(client, i) for i in range(48)])

    results = asyncio.run(run())
    assert len(results) == 48
    want = dict(zip(PROMPTS, texts, strict=True))
    assert all(text == want[p] for p, text in results)


def test_launched_server_bounds_request_heads(server):
    """`tpserve launch` serves with server.http_protocol: a head that keeps growing past
    64 KiB is answered 431 with the error body (uvicorn's own protocol kept reading it)."""
    import contextlib
    import json
    import socket

    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        with contextlib.suppress(OSError):  # the server answers and closes meanwhile
            for _ in range(64):  # 4 MiB at most, in 64 KiB pieces
                s.sendall(b"a" * 65536)
                time.sleep(0.01)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head[:200]
    assert json.loads(body)["error_type"] == "validation"
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200  # others served
