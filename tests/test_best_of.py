"""TGI's `best_of` through the real clients (text_generation's and tpserve's) over the app and
an in-process engine on the embedded default model: the answer is the candidate TGI's rule
picks (highest mean token log-probability), the others come in details.best_of_sequences,
each reported seed replays its candidate alone, TGI's refusals are 422s naming the field,
a client that leaves aborts every candidate, and the server keeps serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from engine_utils import served_engine

from tpserve import protocol as wire
from tpserve.client import AsyncClient, Client
from tpserve.config import ServerConfig
from tpserve.weights import DEFAULT_MODEL_DIR

text_generation = pytest.importorskip("text_generation")

PROMPT = "The river bank"
# Candidates must differ for the choice to mean something: a hot, long enough sample.
SAMPLE = {"do_sample": True, "temperature": 1.5, "max_new_tokens": 12}
MAX_BEST_OF = 3
CONCURRENT = 2  # below MAX_BEST_OF, so best_of = 3 meets the --max-concurrent-requests rule


@pytest.fixture(scope="module")
def served():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=256,
                       max_concurrent_requests=CONCURRENT, block_size=16, num_blocks=128,
                       server=ServerConfig(max_best_of=MAX_BEST_OF)) as (backend, base):
        yield backend, base


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def tgi(url):
    return text_generation.Client(url, timeout=60)


def mean_logprob(tokens) -> float:
    """TGI's score of a candidate (router/src/infer/mod.rs generate_best_of)."""
    return sum(t.logprob for t in tokens) / len(tokens)


def distinct_best_of(tgi, answers: int = 1) -> list:
    """best_of = 2 answers whose candidates differ (sampled ones nearly always do)."""
    got = []
    for _ in range(answers + 4):
        res = tgi.generate(PROMPT, best_of=2, **SAMPLE)
        [other] = res.details.best_of_sequences
        if [t.id for t in other.tokens] != [t.id for t in res.details.tokens]:
            got.append(res)
        if len(got) == answers:
            return got
    pytest.fail(f"too few of {answers + 4} best_of = 2 answers had two different candidates")


@pytest.mark.parametrize("answer", range(6))
def test_tgi_client_gets_the_likeliest_candidate_and_the_other(tgi, answer):
    # Six answers: a server that answered the first or the second candidate regardless
    # would pass all six with odds of 1 in 64.
    [res] = distinct_best_of(tgi)
    details = res.details
    [other] = details.best_of_sequences
    assert mean_logprob(details.tokens) >= mean_logprob(other.tokens)
    for seq in (details, other):
        assert seq.generated_tokens == len(seq.tokens)
        assert seq.finish_reason in ("length", "eos_token")
        assert seq.prefill == []  # no decoder_input_details
    assert res.generated_text == "".join(t.text for t in details.tokens if not t.special)
    assert other.generated_text == "".join(t.text for t in other.tokens if not t.special)
    assert details.seed is not None and other.seed is not None
    assert details.seed != other.seed


def test_reported_seeds_replay_each_candidate(tgi):
    [res] = distinct_best_of(tgi)
    for seq in (res.details, *res.details.best_of_sequences):
        again = tgi.generate(PROMPT, seed=seq.seed, **SAMPLE)
        assert [t.id for t in again.details.tokens] == [t.id for t in seq.tokens]
        assert again.details.seed == seq.seed


def test_tpserve_clients_read_best_of_sequences(url):
    kw = dict(best_of=2, top_n_tokens=2, return_full_text=True, decoder_input_details=True,
              **SAMPLE)
    with Client(url, timeout=60) as client:
        res = client.generate(PROMPT, **kw)
    [other] = res.details.best_of_sequences
    assert isinstance(other, wire.BestOfSequence)
    assert other.generated_text.startswith(PROMPT) and res.generated_text.startswith(PROMPT)
    assert len(other.top_tokens) == other.generated_tokens
    assert [t.id for t in other.prefill] == [t.id for t in res.details.prefill] != []
    assert mean_logprob(res.details.tokens) >= mean_logprob(other.tokens)

    res = asyncio.run(AsyncClient(url, timeout=60).generate(PROMPT, best_of=2, **SAMPLE))
    assert len(res.details.best_of_sequences) == 1


def test_without_details_only_the_winner_comes_back(url):
    body = {"inputs": PROMPT, "parameters": {"best_of": 2, **SAMPLE}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    r = httpx.post(url + "/", json=body, timeout=60)  # TGI's compat route: a list
    assert r.status_code == 200 and [set(a) for a in r.json()] == [{"generated_text"}]


REFUSED = {
    "over_max_best_of": ("/generate", {"best_of": 4, "do_sample": True},
                         "`best_of` must be <= 3 (got 4)"),
    "over_concurrency": ("/generate", {"best_of": 3, "do_sample": True},
                         "--max-concurrent-requests"),
    "zero": ("/generate", {"best_of": 0, "do_sample": True}, "`parameters.best_of`"),
    "greedy": ("/generate", {"best_of": 2}, "`best_of` > 1 needs sampling"),
    "seed": ("/generate", {"best_of": 2, "do_sample": True, "seed": 5},
             "`seed` must not be set when `best_of` > 1"),
    "stream": ("/generate_stream", {"best_of": 2, "do_sample": True},
               "`best_of` != 1 is not supported when streaming"),
    "compat_stream": ("/", {"best_of": 2, "do_sample": True}, "not supported when streaming"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_tgi_rules_are_422s_and_the_server_keeps_serving(url, case):
    route, params, fragment = REFUSED[case]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **params},
            "stream": case == "compat_stream"}
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and fragment in r.json()["error"]
    ok = httpx.post(url + "/generate", json={"inputs": PROMPT,
                                             "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


def test_tgi_client_sees_the_limit_as_its_validation_error(tgi):
    with pytest.raises(text_generation.errors.ValidationError, match="--max-best-of"):
        tgi.generate(PROMPT, best_of=4, do_sample=True, max_new_tokens=2)


def test_info_reports_max_best_of(url):
    assert httpx.get(url + "/info", timeout=10).json()["max_best_of"] == MAX_BEST_OF


def test_a_client_that_leaves_aborts_every_candidate(served):
    backend, url = served
    new_tokens = 240  # ~0.8 s for both candidates on 2 cores; the client leaves after 0.2 s
    body = {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True,
                                             "max_new_tokens": new_tokens}}
    steps = backend.stats()["steps"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(10, read=0.2))
    deadline = time.monotonic() + 10
    while backend.inflight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.inflight == 0
    # Neither candidate ran to its end (one decode step per token).
    assert backend.stats()["steps"] - steps < new_tokens - 40
    # Both slots of --max-concurrent-requests are free again: best_of = 2 runs.
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "best_of": 2, "do_sample": True, "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200


def _candidate(logprobs: list[float | None], seed: int):
    from tpserve.engine.request import GenerationEvent, TokenInfo

    events = [GenerationEvent(TokenInfo(i + 3, f" t{i}", lp)) for i, lp in enumerate(logprobs)]
    final = events[-1]
    final.finished, final.finish_reason, final.seed = True, "length", seed
    final.generated_tokens, final.generated_text = len(events), "".join(
        e.token.text for e in events)
    final.prefill = [TokenInfo(9, "Hi", None)]
    return events


def test_the_rule_mean_logprob_first_of_equals_and_no_number_never_wins():
    from tpserve.server.best_of import best_index

    # Means -0.5 vs -0.4 (the sums would pick the shorter first one).
    assert best_index([_candidate([-0.5], 1), _candidate([-0.4, -0.4], 2)]) == 1
    assert best_index([_candidate([-1.0], 1), _candidate([-0.5, -1.5], 2)]) == 0  # equals
    assert best_index([_candidate([None], 1), _candidate([-9.0], 2)]) == 1


def test_openai_n_best_are_ranked_by_the_same_rule_best_first():
    from tpserve.server.best_of import best_indices

    # Means -0.5, -0.4, -1.0, NaN, -0.4: best first, the first of equals before the other,
    # no number last.
    cands = [_candidate(lps, i) for i, lps in enumerate(
        [[-0.5], [-0.4, -0.4], [-1.0], [None], [-0.2, -0.6]])]
    assert best_indices(cands, 5) == [1, 4, 0, 2, 3]
    assert best_indices(cands, 2) == [1, 4]


@pytest.mark.parametrize("params", [
    {"details": True},
    {"details": True, "decoder_input_details": True, "top_n_tokens": 1,
     "return_full_text": True},
])
def test_best_of_body_has_the_wire_models_shape(params):
    """The answer is built as plain data for speed: it must be what wire.Response gives."""
    import json

    from tpserve.server.app import TGIRoutes
    from tpserve.server.streaming import AnswerResponse

    req = wire.GenerateRequest(inputs="Hi", parameters={"best_of": 2, "do_sample": True,
                                                        **params})
    body = json.loads(AnswerResponse(TGIRoutes.response(
        req, _candidate([-0.1, -0.2], 7), [_candidate([-1.0, -2.0], 8)])).body)
    assert wire.Response.model_validate(body).model_dump(mode="json") == body
    [other] = body["details"]["best_of_sequences"]
    assert other["seed"] == 8 and [t["logprob"] for t in other["tokens"]] == [-1.0, -2.0]
    full = params.get("return_full_text", False)
    assert other["generated_text"] == ("Hi" if full else "") + " t0 t1"
    assert len(other["prefill"]) == (1 if params.get("decoder_input_details") else 0)
    assert ("top_tokens" in other) == bool(params.get("top_n_tokens"))
