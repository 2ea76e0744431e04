"""`tpserve launch --tp 2` per added family (Gemma 1-3, Bloom, Qwen2, Qwen3, Phi-3, Mixtral,
Granite, StarCoder2, Qwen3-MoE, Qwen2-MoE, GPTBigCode, Cohere, Cohere 2, GPT-OSS, DeepSeek-V2 and
-V3, Llama 4; vision-language Gemma 3, Mistral 3, LLaVA-NeXT, Qwen2-VL and Llama 4 served as
text) in a subprocess, asked over HTTP through
tpserve.Client: the served text is transformers' greedy text.

The server joins the session's Ray cluster (--address) rather than starting a second one.
Slow job (bash .ci/run slow): 11-13 s per family on 2 quiet cores, up to ~38 s when shared."""

from __future__ import annotations

import time

import pytest
from server_process import launched
from tiny_models import family_checkpoint, hf_greedy
from transformers import AutoTokenizer

import tpserve

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Hello world, this is a tiny model"]
NEW_TOKENS = 16


def _expected(path) -> list[tuple[list[int], str]]:
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for ids in hf_greedy(path, PROMPTS, NEW_TOKENS):
        if tok.eos_token_id in ids:  # the server stops there; hf_greedy does not
            ids = ids[: ids.index(tok.eos_token_id) + 1]
        out.append((ids, tok.decode(ids, skip_special_tokens=True)))
    return out


def _wait_driver_gone(ray, timeout_s: float = 30.0) -> None:
    """The next launch names its driver actor "driver" too: wait for the last one to go."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor("driver", namespace="tpserve")
        except ValueError:
            return
        time.sleep(0.5)
    raise AssertionError("the previous server's driver actor outlived its process")


FAMILIES = ["gemma", "gemma2", "gemma3", "gemma3-vlm", "bloom", "qwen2", "qwen3", "phi3",
            "mixtral", "granite", "starcoder2", "qwen3-moe", "qwen2-moe", "mistral3",
            "llava-next-mistral", "qwen2-vl", "gpt-bigcode", "cohere", "cohere-qk-norm",
            "cohere2", "gpt-oss", "deepseek-v2", "deepseek-v3", "llama4", "llama4-vlm"]


@pytest.mark.parametrize("name", FAMILIES)
def test_served_text_matches_transformers(ray_cluster, models_dir, tmp_path, name):
    path = family_checkpoint(models_dir, name)
    expected = _expected(path)
    address = ray_cluster.get_runtime_context().gcs_address
    try:
        with launched(["--model", str(path), "--tp", "2", "--address", address],
                      tmp_path / "server.log", ready_timeout=120) as url:
            client = tpserve.Client(url, timeout=60)
            for prompt, (ids, text) in zip(PROMPTS, expected, strict=True):
                r = client.generate(prompt, max_new_tokens=NEW_TOKENS)
                assert [t.id for t in r.details.tokens] == ids
                assert r.generated_text == text
                assert text.strip()  # a real continuation, not an empty match
    finally:
        _wait_driver_gone(ray_cluster)
