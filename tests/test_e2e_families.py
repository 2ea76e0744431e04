"""`tpserve launch --tp 2` over one checkpoint of each kind of family, in a subprocess,
asked over HTTP through tpserve.Client: the served text is transformers' greedy text.

Every family's model code, sharding and plain-data config hand-off (the one the launcher gives
its shards) are checked at tp 1, 2 and 4 in tests/test_tp_families.py, through the same Ray
shard actors; what a launch adds is the same for each family (the CLI's checks, the HTTP
server, the tokenizer, stop tokens) and tests/test_e2e_server.py and test_e2e_t5.py run it.
Launched here: the mission's Gemma and Bloom, a vision-language checkpoint of each config
shape served as text (Gemma 3's nested text_config, Qwen2-VL's, Llama 4's), and one each of
experts (Mixtral), latent attention (DeepSeek-V3) and attention sinks with YaRN (GPT-OSS).

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


FAMILIES = ["gemma", "bloom", "gemma3-vlm", "qwen2-vl", "llama4-vlm", "mixtral", "deepseek-v3",
            "gpt-oss"]


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
