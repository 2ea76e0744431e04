"""Several EOS ids in generation_config.json (as Llama 3 lists them): each ends generation
on both APIs, streamed or not, where transformers' generate ends it. Its own module: a
second in-process engine must not run beside another module's (they share the process's
tensor-parallel state)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from engine_utils import served_engine
from tiny_models import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def two_eos(llama_dir, tmp_path_factory):
    """The Llama checkpoint with generation_config.json listing two EOS ids, the second
    a token greedy decoding reaches on its fifth step (not a special token)."""
    path = tmp_path_factory.mktemp("eos") / "llama-two-eos"
    shutil.copytree(llama_dir, path)
    stop_id = hf_greedy(path, [PROMPT], 8)[0][4]
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, stop_id]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_every_eos_id_of_generation_config_ends_generation(two_eos):
    tok = AutoTokenizer.from_pretrained(two_eos)
    model = AutoModelForCausalLM.from_pretrained(two_eos, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():  # transformers reads the same list from generation_config.json
        want = model.generate(ids, max_new_tokens=12, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    assert len(want) == 5
    with served_engine(two_eos, "two-eos", max_model_len=64,
                       max_concurrent_requests=4) as (_, url):
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
        r = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert [t["id"] for t in r["details"]["tokens"]] == want
        assert r["details"]["finish_reason"] == "eos_token"
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as s:
            events = [json.loads(line[5:]) for line in s.iter_lines()
                      if line.startswith("data:")]
        assert [e["token"]["id"] for e in events] == want
        assert events[-1]["details"]["finish_reason"] == "eos_token"
        assert events[-1]["generated_text"] == r["generated_text"]
        c = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
        assert c["choices"][0]["finish_reason"] == "stop"
        assert c["usage"]["completion_tokens"] == 5
