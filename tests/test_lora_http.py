"""Selecting LoRA adapters over HTTP (the real app over an in-process engine): OpenAI's
`model`, TGI's `parameters.adapter_id` (raw and through tpserve.Client), /v1/models, and the
422 for an unknown adapter; tokens compared with transformers + peft."""

from __future__ import annotations

import pytest
import requests
from engine_utils import served_engine
from lora_utils import oracle_greedy, save_adapter
from transformers import AutoTokenizer

from tpserve.client import Client
from tpserve.config import LoraConfig
from tpserve.errors import ValidationError

BASE = "tiny-llama"
PROMPT = "The quick brown fox"
NEW = 6


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_http")
    return {"a": save_adapter(llama_dir, d / "a", seed=11, r=4, alpha=8),
            "b": save_adapter(llama_dir, d / "b", seed=12, r=2, alpha=4, rslora=True)}


@pytest.fixture(scope="module")
def setup(llama_dir, adapters):
    ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPT).input_ids
    want = {n: oracle_greedy(llama_dir, adapters.get(n), [ids], NEW)[0] for n in (None, "a", "b")}
    assert len({tuple(t) for t in want.values()}) == 3, "oracle guard: adapters must differ"
    lora = LoraConfig(adapters=tuple((n, str(p)) for n, p in adapters.items()))
    with served_engine(llama_dir, BASE, max_model_len=128, max_concurrent_requests=8,
                       lora=lora) as (_, url):
        yield url, want, AutoTokenizer.from_pretrained(llama_dir)


def tgi_tokens(url: str, adapter: str | None) -> list[int]:
    params = {"max_new_tokens": NEW, "details": True}
    if adapter is not None:
        params["adapter_id"] = adapter
    r = requests.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": params},
                      timeout=60)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


@pytest.mark.parametrize("adapter", [None, "a", "b", BASE])
def test_tgi_adapter_id(setup, adapter):
    url, want, _ = setup
    assert tgi_tokens(url, adapter) == want[None if adapter == BASE else adapter]


def test_python_client_adapter_id(setup):
    url, want, _ = setup
    with Client(url, timeout=60) as client:
        out = client.generate(PROMPT, max_new_tokens=NEW, adapter_id="b")
        assert [t.id for t in out.details.tokens] == want["b"]
        with pytest.raises(ValidationError, match="unknown LoRA adapter 'zzz'"):
            client.generate(PROMPT, max_new_tokens=NEW, adapter_id="zzz")


@pytest.mark.parametrize("model", ["a", "b", BASE])
def test_openai_model_selects_adapter(setup, model):
    url, want, tok = setup
    r = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = want[None if model == BASE else model]
    assert r.json()["choices"][0]["text"] == tok.decode(ids)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
    ("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "nope"}}),
])
def test_unknown_adapter_422(setup, route, body):
    url, _, _ = setup
    r = requests.post(url + route, json=body, timeout=60)
    assert r.status_code == 422
    payload = r.json()
    assert payload["error_type"] == "validation"
    assert "unknown LoRA adapter 'nope'" in payload["error"]
    assert "'a', 'b'" in payload["error"] and BASE in payload["error"]


def test_models_lists_adapters(setup):
    url, _, _ = setup
    data = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [BASE, "a", "b"]
    assert data[1]["parent"] == BASE
    assert requests.get(f"{url}/v1/models/a", timeout=10).json()["id"] == "a"
    assert requests.get(f"{url}/v1/models/c", timeout=10).status_code == 404


@pytest.mark.slow
def test_tpserve_launch_tp2_serves_adapters(setup, adapters, llama_dir, tmp_path):
    """The real launch path (launcher, driver, engine core in rank 0, a follower over the
    control channel) at tp 2: adapters a and b by TGI's adapter_id and OpenAI's model."""
    from server_process import launched

    _, want, tok = setup
    args = ["--model", str(llama_dir), "--tp", "2", "--num-blocks", "256", "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items()), "--max-lora-rank", "8"]
    with launched(args, tmp_path / "server.log") as served:
        assert [m["id"] for m in requests.get(f"{served}/v1/models", timeout=10).json()[
            "data"]] == [str(llama_dir), "a", "b"]
        for adapter in ("a", None):
            assert tgi_tokens(served, adapter) == want[adapter]
        r = requests.post(f"{served}/v1/completions", timeout=60, json={
            "model": "b", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
        assert r.json()["choices"][0]["text"] == tok.decode(want["b"])
        assert tgi_status(served, "nope") == 422


def tgi_status(url: str, adapter: str) -> int:
    return requests.post(f"{url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"adapter_id": adapter}}).status_code
