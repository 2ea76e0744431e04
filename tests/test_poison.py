"""One bad request must not fail everyone: while three long generations run on the real
engine (tp = 1, tiny Llama, CPU), requests with a denormal temperature, a vanishing
repetition penalty or a lone surrogate get a 4xx or their own answer, and the three long
generations complete with the same text as when they ran alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from engine_utils import served_engine

LONG = ["The quick brown fox", "Hello world, this is", "Once upon a time"]
LONG_TOKENS = 80
POISON = {
    "temperature_5e-324": {"inputs": "Hi", "parameters": {
        "do_sample": True, "temperature": 5e-324, "max_new_tokens": 8}},
    "temperature_1e-38": {"inputs": "Hi", "parameters": {
        "do_sample": True, "temperature": 1e-38, "max_new_tokens": 8}},
    "repetition_penalty_1e-40": {"inputs": "Hi Hi Hi", "parameters": {
        "do_sample": True, "repetition_penalty": 1e-40, "max_new_tokens": 8}},
    "temperature_1e-38_top_p": {"inputs": "Hi", "parameters": {
        "temperature": 1e-38, "top_p": 0.5, "typical_p": 0.5, "max_new_tokens": 8}},
}


@pytest.fixture(scope="module")
def real_server(llama_dir):
    with served_engine(llama_dir, "tiny", max_model_len=256, max_concurrent_requests=16) as s:
        yield s


def _long_body(prompt: str) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": LONG_TOKENS}}


def test_poison_requests_fail_alone(real_server):
    backend, url = real_server
    alone = [httpx.post(url + "/generate", json=_long_body(p), timeout=120).json()
             for p in LONG]
    started = threading.Barrier(len(LONG) + 1, timeout=60)
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        text, first = None, True
        with httpx.stream("POST", url + "/generate_stream", json=_long_body(LONG[i]),
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if first:
                    started.wait()
                    first = False
                event = json.loads(line[5:])
                if "error" in event:
                    text = f"ERROR {event}"
                    break
                if event.get("generated_text") is not None:
                    text = event["generated_text"]
        results[i] = text

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(LONG))]
    for t in threads:
        t.start()
    started.wait()  # all three are generating: the poison joins their batch
    answers = {name: httpx.post(url + "/generate", json=body, timeout=60)
               for name, body in POISON.items()}
    surrogate = httpx.post(url + "/generate", content=b'{"inputs": "a\\ud800"}', timeout=60)
    for t in threads:
        t.join(timeout=120)

    assert surrogate.status_code == 422
    for name, r in answers.items():
        # Its own answer (greedy fallback), a 4xx, or its own error; never a crash.
        assert set(r.json()) <= {"generated_text", "error", "error_type"}, (name, r.text)
    assert [results.get(i) for i in range(len(LONG))] == [a["generated_text"] for a in alone]
    # And the engine is idle and whole afterwards.
    assert backend.engine.scheduler.blocks.num_free == backend.engine.num_blocks
    again = httpx.post(url + "/generate", json=_long_body(LONG[0]), timeout=120).json()
    assert again == alone[0]
