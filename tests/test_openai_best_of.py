"""OpenAI's `best_of` on /v1/completions through the real `openai` client, over the app and an
in-process engine on the embedded default model: the n choices are the best of best_of
candidates by mean token log-probability, checked against each candidate replayed alone
(candidate i of a seeded request is the request with seed + i and no best_of) and ranked
here; usage counts every candidate; greedy requests generate n; OpenAI's refusals are 422s."""

from __future__ import annotations

import json

import pytest
from engine_utils import served_engine

from tpserve.config import ServerConfig
from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

MAX_BEST_OF = 3
CONCURRENT = 6
MAX_TOKENS = 8
# A hot sample, so candidates differ.
SAMPLE = {"temperature": 1.5, "max_tokens": MAX_TOKENS}


def _no_eos() -> dict[str, int]:
    """logit_bias that keeps the end-of-sequence tokens out: every candidate then runs to
    max_tokens, and its returned log-probabilities cover every token it was ranked by (the
    ranking counts an end-of-sequence token; OpenAI's logprobs leave it out)."""
    gen = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
                  ["eos_token_id"])
    return {str(i): -100 for i in (eos if isinstance(eos, list) else [eos])}


@pytest.fixture(scope="module")
def client():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=256,
                       max_concurrent_requests=CONCURRENT, block_size=16, num_blocks=128,
                       server=ServerConfig(max_best_of=MAX_BEST_OF)) as (_, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                            timeout=60)


def replay(client, prompt: str, seed: int, **kw):
    """Candidate `seed` alone: its text, mean token log-probability and log-probabilities."""
    choice = client.completions.create(model="m", prompt=prompt, seed=seed, logprobs=0,
                                       logit_bias=_no_eos(), **SAMPLE, **kw).choices[0]
    assert choice.finish_reason == "length"
    lps = choice.logprobs.token_logprobs
    assert len(lps) == MAX_TOKENS
    return choice.text, sum(lps) / len(lps), choice.logprobs


def expected(client, prompt: str, seed: int, best_of: int, n: int) -> tuple[list[str], list]:
    """The texts of the n best of the candidates (seeds seed .. seed + best_of - 1), best
    first, the first of equals; and every candidate's replay."""
    cands = [replay(client, prompt, seed + i) for i in range(best_of)]
    order = sorted(range(best_of), key=lambda i: (-cands[i][1], i))
    # Replayed alone, a token's log-probability may differ from the batched one in the last
    # float bits: the seeds are chosen so no two means are that close.
    means = sorted(c[1] for c in cands)
    assert all(b - a > 1e-3 for a, b in zip(means, means[1:])), means
    return [cands[i][0] for i in order[:n]], cands


@pytest.mark.parametrize("n", [1, 2])
def test_choices_are_the_best_candidates_by_mean_logprob(client, n):
    picked_not_first = False
    for seed in (11, 12, 13, 14):
        res = client.completions.create(model="m", prompt="The river", n=n, best_of=3,
                                        seed=seed, logit_bias=_no_eos(), **SAMPLE)
        want, cands = expected(client, "The river", seed, 3, n)
        assert len({c[0] for c in cands}) == 3, "candidates should differ"
        assert [c.text for c in res.choices] == want
        assert [c.index for c in res.choices] == list(range(n))
        assert all(c.finish_reason == "length" for c in res.choices)
        # Every candidate's tokens are counted (OpenAI bills them all).
        assert res.usage.completion_tokens == 3 * MAX_TOKENS
        picked_not_first |= want != [c[0] for c in cands[:n]]
    # Some seed's best were not simply the first candidates started.
    assert picked_not_first


def test_each_prompt_of_a_list_gets_its_own_best(client):
    prompts = ["The river", "A small"]
    res = client.completions.create(model="m", prompt=prompts, n=1, best_of=3, seed=21,
                                    logit_bias=_no_eos(), **SAMPLE)
    assert [c.text for c in res.choices] == [expected(client, p, 21, 3, 1)[0][0]
                                             for p in prompts]
    alone = [client.completions.create(model="m", prompt=p, max_tokens=1).usage.prompt_tokens
             for p in prompts]
    assert res.usage.prompt_tokens == sum(alone)  # each prompt once, not once per candidate
    assert res.usage.completion_tokens == 2 * 3 * MAX_TOKENS


def test_echo_and_logprobs_are_the_chosen_candidates(client):
    res = client.completions.create(model="m", prompt="The river", best_of=2, seed=31,
                                    logprobs=1, echo=True, logit_bias=_no_eos(), **SAMPLE)
    [choice] = res.choices
    [text], cands = expected(client, "The river", 31, 2, 1)
    [(_, _, lp)] = [c for c in cands if c[0] == text]
    assert choice.text == "The river" + text
    prompt_len = len(choice.logprobs.tokens) - MAX_TOKENS
    assert prompt_len > 0 and choice.logprobs.token_logprobs[0] is None  # the prompt's first
    assert choice.logprobs.tokens[prompt_len:] == lp.tokens
    # Batched and alone, the same numbers up to the last float bits.
    assert choice.logprobs.token_logprobs[prompt_len:] == pytest.approx(lp.token_logprobs,
                                                                        abs=1e-4)


def test_greedy_best_of_answers_the_greedy_choices_and_generates_only_n(client):
    plain = client.completions.create(model="m", prompt="The river", temperature=0,
                                      max_tokens=MAX_TOKENS, logit_bias=_no_eos())
    res = client.completions.create(model="m", prompt="The river", temperature=0, n=2,
                                    best_of=3, max_tokens=MAX_TOKENS, logit_bias=_no_eos())
    assert [c.text for c in res.choices] == [plain.choices[0].text] * 2
    assert res.usage.completion_tokens == 2 * MAX_TOKENS


@pytest.mark.parametrize("kw,fragment", [
    ({"n": 2, "best_of": 1}, "`best_of` must be >= `n`"),
    ({"best_of": 2, "stream": True}, "`best_of` > `n` cannot be used with `stream`"),
    ({"best_of": 4}, "`best_of` must be <= 3 (got 4)"),
    ({"best_of": 4, "temperature": 0}, "--max-best-of"),  # the bound holds when greedy too
    ({"best_of": 3, "prompt": ["a", "b", "c"]}, "3 prompt(s) x `best_of` = 3"),
])
def test_refusals_are_422_naming_the_field(client, kw, fragment):
    body = {"model": "m", "prompt": "The river", "max_tokens": 2, **kw}
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.completions.create(**body)
    payload = err.value.response.json()
    assert payload["error_type"] == "validation" and fragment in payload["error"], payload
    # The server keeps serving; best_of equal to n streams as n choices do.
    chunks = list(client.completions.create(model="m", prompt="The river", n=2, best_of=2,
                                            max_tokens=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
