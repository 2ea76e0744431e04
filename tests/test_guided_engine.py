"""Guided decoding in the engine (tiny random Llama): greedy output equals transformers'
greedy output under a logits processor applying llguidance's own mask (tp 1 and 2), sampled
output always parses and matches (a random model gets there only through the mask), and
unguided requests beside guided ones are unchanged."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from engine_utils import make_engine
from tiny_models import PROMPTS

from tpserve.engine.guided import grammar_text
from tpserve.engine.request import GuidedSpec, SamplingParams
from tpserve.engine.step import PENDING_TOKEN

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tag": {"enum": ["red", "green"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tag", "ok"],
    "additionalProperties": False,
}
# The same schema with no whitespace between tokens (llguidance's own option, read from the
# schema): a random model's output then ends well within the token budget.
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
N = 24


def json_spec(schema) -> GuidedSpec:
    return GuidedSpec("json_schema", json.dumps(schema))


def run(engine, prompts, params_list, seqs_out=None):
    """Every request to the end: (output ids, finish reason, text) of each, in order."""
    seqs = [engine.add_request(engine.tokenize(p), q) for p, q in zip(prompts, params_list)]
    if seqs_out is not None:
        seqs_out.extend(seqs)
    done = {}
    for _ in range(3000):
        events, _ = engine.step()
        for sid, ev in events:
            if ev.finished:
                done[sid] = (ev.finish_reason, ev.generated_text)
        if len(done) == len(seqs):
            break
    assert len(done) == len(seqs), "the engine stopped making progress"
    for s in seqs:
        assert PENDING_TOKEN not in s.output_ids
    return [(list(s.output_ids), *done[s.seq_id]) for s in seqs]


class MaskProcessor:
    """A transformers logits processor that applies llguidance's mask of a matcher fed with
    the tokens generated so far (batch of one)."""

    def __init__(self, matcher, prompt_len: int) -> None:
        self.m, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.m.consume_token(int(input_ids[0, -1])), self.m.get_error()
        words = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: scores.shape[1]].astype(bool)
        return scores.masked_fill(~torch.from_numpy(bits)[None], float("-inf"))


def hf_guided_greedy(path, prompts, spec: GuidedSpec, n: int) -> list[list[int]]:
    from llguidance.hf import from_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lltok = from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=tok.eos_token_id)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        proc = MaskProcessor(llguidance.LLMatcher(lltok, grammar_text(spec)), ids.shape[1])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 logits_processor=LogitsProcessorList([proc]))
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


SPECS = {"json": json_spec(SCHEMA), "regex": GuidedSpec("regex", REGEX)}


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return {k: hf_guided_greedy(llama_dir, PROMPTS, spec, N) for k, spec in SPECS.items()}


@pytest.fixture(scope="module")
def engine(llama_dir):
    e = make_engine(llama_dir, 1, local=True)
    yield e
    e.shutdown()


def test_greedy_equals_transformers_with_the_same_mask_tp1(engine, oracle):
    for kind, spec in SPECS.items():
        got = run(engine, PROMPTS, [SamplingParams(max_new_tokens=N, guided=spec)] * 4)
        assert [ids for ids, _, _ in got] == oracle[kind], kind
    assert engine.scheduler.blocks.num_free == engine.num_blocks


def test_greedy_equals_transformers_with_the_same_mask_tp2(llama_dir, oracle):
    # At tp 2 the steps go to rank 0's actor (pickled, masks included); it samples.
    engine = make_engine(llama_dir, 2, forked=True)
    try:
        for kind, spec in SPECS.items():
            got = run(engine, PROMPTS, [SamplingParams(max_new_tokens=N, guided=spec)] * 4)
            assert [ids for ids, _, _ in got] == oracle[kind], kind
    finally:
        engine.shutdown()


def test_sampled_outputs_always_match_the_grammar(engine):
    seeds = range(6)
    json_params = [SamplingParams(max_new_tokens=120, do_sample=True, temperature=1.0, seed=s,
                                  top_k=50 if s % 2 else None, guided=json_spec(COMPACT))
                   for s in seeds]
    regex_params = [SamplingParams(max_new_tokens=40, do_sample=True, temperature=1.0, seed=s,
                                   guided=GuidedSpec("regex", REGEX)) for s in seeds]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in seeds]
    got = run(engine, prompts * 2, json_params + regex_params)
    texts = set()
    for (_, reason, text), params in zip(got, json_params + regex_params):
        assert reason == "eos_token", (reason, text)  # complete, then the forced EOS
        if params.guided.kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > len(seeds)  # sampled, not one forced string


def test_default_whitespace_is_bounded_and_json_object_is_any_object(engine):
    # tpserve's whitespace rule: one space, or a line break and at most 32 blanks.
    params = [SamplingParams(max_new_tokens=200, do_sample=True, temperature=1.0, seed=s,
                             guided=json_spec(SCHEMA)) for s in range(2)]
    params.append(SamplingParams(max_new_tokens=40, do_sample=True, seed=7,
                                 guided=GuidedSpec("json_schema", '{"type":"object"}')))
    for _, reason, text in run(engine, ["Hello world", "A", "The quick brown fox"], params):
        between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # strings may hold any spaces
        assert not re.search(r"\n[ \t]{33}|\n\n|[^\n \t] {2}|\t\n", between), text
        if reason == "eos_token":
            assert isinstance(json.loads(text), dict)
        else:  # an object of any shape may run past the budget: cut, as OpenAI's is
            assert reason == "length" and text.lstrip().startswith("{")


def test_unguided_requests_beside_guided_ones_are_unchanged(engine):
    plain = [SamplingParams(max_new_tokens=16, ignore_eos=True),
             SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.8, seed=11),
             SamplingParams(max_new_tokens=16, do_sample=True, top_p=0.9, seed=5,
                            logit_bias=((7, 3.0),))]
    alone = run(engine, PROMPTS[:3], plain)
    guided = SamplingParams(max_new_tokens=30, guided=json_spec(SCHEMA))
    mixed = run(engine, [*PROMPTS[:3], PROMPTS[3]], [*plain, guided])
    assert mixed[:3] == alone


def test_stop_strings_length_and_logprobs_of_guided_requests(engine):
    spec = GuidedSpec("regex", "(ab)+c")
    # The length limit cuts a grammar short, as it cuts any request.
    (ids, reason, text), = run(engine, ["Hello world"],
                               [SamplingParams(max_new_tokens=1, guided=spec)])
    assert reason == "length" and len(ids) == 1 and text.startswith("a")
    assert not re.fullmatch("(ab)+c", text)
    # A stop string ends it in the driver, like any other request.
    (_, reason, text), = run(engine, ["Hello world"], [SamplingParams(
        max_new_tokens=30, guided=GuidedSpec("regex", "(ab){5}c"), stop=("bab",))])
    assert reason == "stop_sequence" and text == "abab"
    # Log-probabilities are over the allowed tokens: a token the grammar forces has log p 0,
    # and no forbidden token is listed as an alternative.
    for raw, sample in ((True, False), (True, True), (False, True)):  # OpenAI's, TGI's
        seq = engine.add_request(engine.tokenize("Hello"), SamplingParams(
            max_new_tokens=6, top_n_tokens=3, raw_logprobs=raw, do_sample=sample, seed=1,
            guided=GuidedSpec("regex", "a")))
        events = []
        while engine.has_work():
            events += [ev for sid, ev in engine.step()[0] if sid == seq.seq_id]
        a = engine.tokenize("a", add_special_tokens=False)
        assert [ev.token.id for ev in events] == a + [1]
        for ev in events:
            assert ev.token.logprob == pytest.approx(0.0, abs=1e-6)
            assert [t.id for t in ev.top_tokens] == [ev.token.id]


@pytest.fixture(scope="module")
def small_engine(llama_dir, engine):
    # Shut down with the module's other engine (after it), not mid-module: an in-process
    # engine's shutdown clears the process's tensor-parallel state, which both read.
    e = make_engine(llama_dir, 1, local=True, num_blocks=24, prefix_caching=True)
    yield e
    e.shutdown()


def test_preemption_and_prefix_caching_keep_guided_output(engine, small_engine):
    params = [SamplingParams(max_new_tokens=40, do_sample=True, seed=s,
                             guided=json_spec(COMPACT)) for s in range(4)]
    prompts = [PROMPTS[2]] * 4  # one long prompt: shared blocks with prefix caching
    roomy = run(engine, prompts, params)
    seqs = []
    assert run(small_engine, prompts, params, seqs) == roomy
    assert any(s.num_preemptions for s in seqs)  # recomputed from its tokens
    assert small_engine.scheduler.blocks.hits  # and prompt blocks were shared


def test_bad_grammars_are_refused_with_the_reason(engine):
    from tpserve.errors import ValidationError

    with pytest.raises(ValidationError, match="regular expression does not compile"):
        engine.check_grammar(GuidedSpec("regex", "a(b", "parameters.grammar"))
    with pytest.raises(ValidationError, match=r"`response_format`: the JSON schema .*foo"):
        engine.add_request([5, 6], SamplingParams(guided=GuidedSpec(
            "json_schema", '{"type": "foo"}', "response_format")))
    assert not engine.has_work()  # refused before it was queued


def test_only_steps_holding_guided_rows_give_up_the_overlap(engine):
    plain = engine.add_request(engine.tokenize("Hello world"),
                               SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._inflight is not None  # overlapped: launched, collected next step
    guided = engine.add_request(engine.tokenize("A"), SamplingParams(
        max_new_tokens=8, guided=GuidedSpec("regex", "[a-z]{20}")))
    engine.step()  # its prefill and first token: collected at once
    while guided.seq_id in engine.requests:
        assert engine._inflight is None
        engine.step()
    while engine.has_work():
        engine.step()
    assert plain.finish_reason == "length" and len(plain.output_ids) == 8


def test_an_eos_id_past_the_tokenizer_does_not_break_every_grammar(llama_dir):
    """A config may name an end-of-sequence id the tokenizer lacks (a model vocabulary larger
    than the tokenizer's): llguidance refuses such an id, so it stays out of the grammar's
    EOS set instead of making every guided request a 422."""
    from transformers import AutoTokenizer

    from tpserve.engine.guided import Grammars, GuidedVocab

    tok = AutoTokenizer.from_pretrained(llama_dir)
    past = len(tok) + 5
    vocab = GuidedVocab.from_tokenizer(tok, past + 10, [tok.eos_token_id, past])
    assert vocab.eos_ids == [tok.eos_token_id] and vocab.n_vocab == past + 10
    matcher = Grammars(vocab).matcher(SPECS["regex"])  # compiles: no ValidationError
    assert matcher is not None


def test_an_llguidance_without_eos_lists_gets_the_first_eos_id(llama_dir, monkeypatch):
    """llguidance 1.6 takes one EOS id, not a list (a GPU machine's preinstalled copy refused
    every guided request with a TypeError): the tokenizer is built with the first id, and a
    grammar still ends on it."""
    import llguidance
    from transformers import AutoTokenizer

    from tpserve.engine.guided import Grammars, GuidedVocab

    real, seen = llguidance.LLTokenizer, []

    def one_id_only(text, n_vocab=None, eos_token=None):
        seen.append(eos_token)
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an "
                            "integer")
        return real(text, n_vocab=n_vocab, eos_token=eos_token)

    monkeypatch.setattr(llguidance, "LLTokenizer", one_id_only)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    eos = [tok.eos_token_id, tok.bos_token_id]
    vocab = GuidedVocab.from_tokenizer(tok, len(tok), eos)
    matcher = Grammars(vocab).matcher(GuidedSpec("regex", "ab", "grammar"))
    assert seen == [sorted(eos), sorted(eos)[0]]
    for token_id in tok.encode("ab", add_special_tokens=False):
        assert matcher.accept(token_id), matcher.error
    first = sorted(eos)[0]
    words = matcher.mask().view(np.uint32)
    assert words[first // 32] >> (first % 32) & 1  # the grammar may end on the first EOS
