"""Whole answers (/generate, OpenAI without stream) are encoded by orjson: the same JSON as
the standard encoder writes, UTF-8 unescaped, and a NaN log-probability as null (JSON has no
NaN; Starlette's encoder raised on it), with orjson and without it."""

from __future__ import annotations

import json
import math

import pytest

import tpserve.server.streaming as streaming
from tpserve.server.streaming import AnswerResponse

BODY = {"generated_text": "héllo ✓ \"q\"\n", "details": {
    "finish_reason": "length", "generated_tokens": 3, "seed": None, "prefill": [],
    "tokens": [{"id": 5, "text": "hé", "logprob": -0.25, "special": False},
               {"id": 2**40, "text": "</s>", "logprob": -1e-05, "special": True},
               {"id": 7, "text": "✓", "logprob": -12.125, "special": False}]}}


@pytest.mark.parametrize("with_orjson", [True, False])
def test_same_json_as_the_standard_encoder(with_orjson, monkeypatch):
    if not with_orjson:
        monkeypatch.setattr(streaming, "orjson", None)
    elif streaming.orjson is None:
        pytest.fail("orjson is a dependency (pyproject.toml) and should be installed")
    raw = AnswerResponse(BODY).body
    assert json.loads(raw) == BODY
    assert "héllo ✓".encode() in raw  # not \\u-escaped


@pytest.mark.parametrize("with_orjson", [True, False])
def test_nan_and_infinite_logprobs_become_null(with_orjson, monkeypatch):
    if not with_orjson:
        monkeypatch.setattr(streaming, "orjson", None)
    body = {"tokens": [{"id": 1, "logprob": math.nan}, {"id": 2, "logprob": -0.5},
                       {"id": 3, "logprob": -math.inf}], "nested": [[math.nan]]}
    got = json.loads(AnswerResponse(body).body)
    assert got == {"tokens": [{"id": 1, "logprob": None}, {"id": 2, "logprob": -0.5},
                              {"id": 3, "logprob": None}], "nested": [[None]]}
    assert body["tokens"][0]["logprob"] != body["tokens"][0]["logprob"]  # input untouched


@pytest.mark.parametrize("with_orjson", [True, False])
def test_numpy_scalars_are_written_as_numbers(with_orjson, monkeypatch):
    np = pytest.importorskip("numpy")
    if not with_orjson:
        monkeypatch.setattr(streaming, "orjson", None)
    body = {"logprob": np.float64(-0.25), "id": np.int64(7), "ok": True}
    if not with_orjson:  # the standard encoder writes float64 (a float) but not int64
        body["id"] = 7
    assert json.loads(AnswerResponse(body).body) == {"logprob": -0.25, "id": 7, "ok": True}


def test_unknown_objects_still_fail_loudly():
    with pytest.raises(TypeError):
        AnswerResponse({"x": object()})
