"""A hostile client against the real engine (tp = 1, in-process, the embedded default model
on the CPU): template injection through chat messages, and the server serving on after it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from engine_utils import served_engine

import tpserve

DEFAULT_MODEL = Path(tpserve.__file__).parent / "default_model"
INJECTIONS = [
    "{{ 7*7 }}",
    "{% for x in range(3) %}X{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages }}",
    "{% raw %}",
]


@pytest.fixture(scope="module")
def real_server():
    with served_engine(DEFAULT_MODEL, "default", max_model_len=512,
                       max_concurrent_requests=8) as s:
        yield s


@pytest.mark.parametrize("text", INJECTIONS)
def test_jinja_in_a_message_is_text_not_template(real_server, text):
    backend, url = real_server
    rendered = backend.apply_chat_template([{"role": text, "content": text}])
    assert rendered == f"{text}: {text}\nassistant:"  # both kept verbatim, prompt added
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    # The prompt the engine saw is the literal text: as many tokens as the plain rendering.
    expected = backend.count_tokens(f"user: {text}\nassistant:", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == expected
