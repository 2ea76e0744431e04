"""`tpserve launch --tp 2` on a T5 checkpoint in a subprocess, asked through tpserve.Client:
the served text is transformers' greedy text."""

from __future__ import annotations

import pytest
from server_process import launched
from tiny_models import hf_greedy, save_t5_model, t5_config
from transformers import AutoTokenizer

import tpserve

PROMPTS = ["The quick brown fox", "Ray actors hold one shard each and all-reduce after row "
           "parallel layers, and a paged cache"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def t5_dir(models_dir):
    return save_t5_model(t5_config(flan=True), models_dir / "t5-flan-e2e")


def test_served_text_matches_transformers(t5_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(t5_dir)
    expected = []
    for ids in hf_greedy(t5_dir, PROMPTS, NEW_TOKENS):
        if tok.eos_token_id in ids:  # the server stops there (hf_greedy does not)
            ids = ids[: ids.index(tok.eos_token_id) + 1]
        expected.append((ids, tok.decode(ids, skip_special_tokens=True)))
    with launched(["--model", str(t5_dir), "--tp", "2"], tmp_path / "server.log") as url:
        client = tpserve.Client(url, timeout=60)
        for prompt, (ids, text) in zip(PROMPTS, expected, strict=True):
            r = client.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert r.generated_text == text
            assert [t.id for t in r.details.tokens] == ids
            assert text.strip()  # a real continuation, not an empty match
