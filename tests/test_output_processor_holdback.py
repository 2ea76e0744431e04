"""Hold-back for OpenAI's include_stop=False: the output processor keeps, per stop string, how
many characters at the end of the text may begin it, updated as text arrives. Checked against
the definition (the longest k < len(stop) such that the text ends with stop[:k]) on random and
adversarial texts, and through the processor with a stop string of the longest allowed kind."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tpserve.engine.output_processor import OutputProcessor, _StopTails
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.request import SamplingParams

LONG_STOP = "a" * 511 + "b"


def overlap(text: str, stop: str) -> int:
    """The definition: the longest k < len(stop) such that text ends with stop[:k]."""
    return max((k for k in range(len(stop)) if text.endswith(stop[:k])), default=0)


def check_growing(text: str, stops: tuple[str, ...], rng: random.Random) -> None:
    """Feed `text` in random pieces (some empty); after each, every stop's tail and the hold
    must be the definition's on the text so far."""
    tails = _StopTails(stops)
    assert tails.hold("") == 0
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.choice([0, 1, 1, 1, 2, 3, 7, 40]))
        seen = text[:end]
        expected = [overlap(seen, s) for s in stops]
        assert tails.hold(seen) == max(expected, default=0), (seen, stops)
        assert tails.tails == expected, (seen, stops)


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé😀\x00", "ab\u0301b\u0301"])
def test_random_texts_hold_what_the_definition_says(alphabet):
    rng = random.Random(alphabet)
    for _ in range(300):
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 9)))
                      for _ in range(rng.randrange(1, 4)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        check_growing(text, stops, rng)


def fibonacci_word(n: int) -> str:
    a, b = "a", "ab"
    while len(b) < n:
        a, b = b, b + a
    return b[:n]


@pytest.mark.parametrize("text, stop", [
    ("", "ab"),
    ("", "a"),
    ("a" * 50, "a"),
    ("xyz", "z"),
    ("a" * 1200, LONG_STOP),
    ("a" * 600 + "b" + "a" * 600, LONG_STOP),  # the whole stop, then its prefix again
    ("a" * 1200, "a" * 256 + "c" + "a" * 255),
    ("a" * 1200, "b" + "a" * 511),
    ("ab" * 600 + "a", "ab" * 255 + "ac"),
    ("aab" * 300, "aab" * 170 + "aac"),
    (fibonacci_word(1500), fibonacci_word(510) + "c"),  # many borders: long failure walks
    (fibonacci_word(1500), fibonacci_word(512)),
    ("é" * 700, "é" * 300 + "😀"),
    ("😀" * 40 + "\x00", "😀" * 20 + "\x00😀"),
])
def test_adversarial_texts_hold_what_the_definition_says(text, stop):
    check_growing(text, (stop,), random.Random(len(text)))


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def stream(tok, ids: list[int], params: SamplingParams):
    """Feed ids one step at a time, the core finishing on length at the last; (events, stopped)."""
    proc = OutputProcessor(tok, frozenset(tok.all_special_ids))
    proc.add(7, params)
    events, stopped = [], []
    for i, t in enumerate(ids):
        reason = "length" if i == len(ids) - 1 else None
        evs, stop = proc.process([TokenOutput(7, t, -0.5, [], i + 1, 3, reason)])
        events += [e for _, e in evs]
        stopped += stop
    return events, stopped


def test_a_long_stop_holds_back_its_prefix_and_stops_on_the_last_character(tok):
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    params = SamplingParams(max_new_tokens=2000, stop=(LONG_STOP,),
                            include_stop_str_in_output=False)
    # 'a' * 300 + 'b' is no stop: what was held back goes out with the 'b'.
    ids = [a] * 300 + [b] + [a] * 600 + [b] + [a] * 5
    events, stopped = stream(tok, ids, params)
    pieces = [e.token.text for e in events]
    assert pieces[:300] == [""] * 300
    assert pieces[300] == "a" * 300 + "b"
    assert pieces[301:812] == [""] * 511  # 511 'a's may begin the stop
    assert pieces[812:901] == ["a"] * 89  # from then on, each new 'a' frees the oldest
    final = events[-1]
    assert len(events) == 902 and stopped == [7]  # the tokens after the stop are dropped
    assert final.finish_reason == "stop_sequence"
    assert final.generated_text == "a" * 300 + "b" + "a" * 89
    assert "".join(pieces) == final.generated_text


def test_a_long_stop_never_completed_releases_everything_at_the_end(tok):
    a = tok.convert_tokens_to_ids("a")
    params = SamplingParams(max_new_tokens=700, stop=(LONG_STOP,),
                            include_stop_str_in_output=False)
    events, stopped = stream(tok, [a] * 700, params)
    pieces = [e.token.text for e in events]
    assert pieces[:511] == [""] * 511 and pieces[511:699] == ["a"] * 188
    assert events[-1].finish_reason == "length" and stopped == []
    assert events[-1].generated_text == "a" * 700 == "".join(pieces)
