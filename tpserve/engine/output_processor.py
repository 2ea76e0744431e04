"""Token ids to text, and every stop-string rule, in one place.

The engine core decides EOS and length (they free KV blocks where they happen); stop strings
need text, so they are found here, after incremental detokenization. A request that hits a
stop string is returned in `stopped` so the caller finishes it in the core; tokens the core
produced for it after that are dropped, so the output is the same as if it had stopped at once.

include_stop (SamplingParams.include_stop_str_in_output) serves both conventions: TGI returns
the stop string as part of the text (True, the default), OpenAI returns the text before it
(False). With False, streamed text that could be the start of a stop string is held back
until it is known not to be one, so the streamed pieces always add up to generated_text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tpserve.engine.detokenizer import IncrementalDetokenizer, decode_keeping
from tpserve.engine.outputs import TokenOutput, packed_rows
from tpserve.engine.request import FinishReason, GenerationEvent, SamplingParams, TokenInfo


@dataclass
class _Request:
    params: SamplingParams
    detok: IncrementalDetokenizer
    ids: list[int] = field(default_factory=list)
    prefill: list[TokenInfo] = field(default_factory=list)
    prefill_top: list[list[TokenInfo]] | None = None
    emitted: int = 0  # characters of detok.text streamed so far (include_stop=False)
    longest: int = 0  # the longest stop string's length (0: no stop strings)
    tails: _StopTails | None = None  # include_stop=False: what may begin a stop string
    # Special tokens whose text stays (params.keep_special_ids that decoding would drop).
    kept: frozenset[int] = frozenset()


class OutputProcessor:
    def __init__(self, tokenizer, special_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.requests: dict[int, _Request] = {}
        self._dropped: dict[int, bool] = {}  # token id: whether decoding leaves it out

    def _drops(self, tid: int) -> bool:
        if tid not in self._dropped:
            self._dropped[tid] = tid in self.special_ids or (
                self.tokenizer.decode([tid], skip_special_tokens=True) == ""
                and self.tokenizer.decode([tid], skip_special_tokens=False) != "")
        return self._dropped[tid]

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self.requests[seq_id] = _Request(
            params, IncrementalDetokenizer(self.tokenizer, self.special_ids),
            longest=max(map(len, params.stop), default=0),
            tails=None if params.include_stop_str_in_output else _StopTails(params.stop),
            kept=frozenset(t for t in params.keep_special_ids if self._drops(t)))

    def remove(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)

    def process(self, outputs: list[TokenOutput]
                ) -> tuple[list[tuple[int, GenerationEvent]], list[int]]:
        """Events for the outputs of known requests, and the ids that hit a stop string
        (finish them in the engine core)."""
        return self._process((o.seq_id, o.token_id, o.logprob, o.top, o.generated_tokens,
                              o.prompt_tokens, o.finish_reason, o.prefill) for o in outputs)

    def process_packed(self, packed: dict
                       ) -> tuple[list[tuple[int, GenerationEvent]], list[int]]:
        """process(unpack_outputs(packed)) without building a TokenOutput per token."""
        return self._process(packed_rows(packed))

    def _process(self, rows: Iterable[tuple]
                 ) -> tuple[list[tuple[int, GenerationEvent]], list[int]]:
        events, stopped = [], []
        requests = self.requests
        for row in rows:
            seq_id = row[0]
            req = requests.get(seq_id)
            if req is None:  # finished or aborted: a late token is dropped
                continue
            ev = self._event(req, *row[1:])
            if ev.finished:
                requests.pop(seq_id, None)
                if ev.finish_reason == "stop_sequence" and row[6] is None:
                    stopped.append(seq_id)
            events.append((seq_id, ev))
        return events, stopped

    def token_info(self, tid: int, logprob: float | None) -> TokenInfo:
        text = self.tokenizer.decode([tid], skip_special_tokens=False)
        return TokenInfo(tid, text, logprob, tid in self.special_ids)

    def _event(self, req: _Request, tid: int, logprob: float, top_ids: list, generated: int,
               prompt_tokens: int, core_reason: FinishReason | None,
               prefill: list | None) -> GenerationEvent:
        p = req.params
        req.ids.append(tid)
        if prefill is not None:
            req.prefill = [self.token_info(t, lp) for t, lp, _ in prefill]
            if p.top_n_tokens:
                req.prefill_top = [[self.token_info(a, b) for a, b in top]
                                   for _, _, top in prefill]
        kept = tid in req.kept
        special = tid in self.special_ids and not kept
        text = new = req.detok.add_kept(tid) if kept else req.detok.add(tid)
        if special:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
        reason = core_reason
        # A stop string outranks length (as it did when one loop checked both), not EOS.
        # Only text this token added can complete one (earlier text was checked before).
        if new and req.longest and reason != "eos_token" \
                and _find_stop(req.detok.text, p.stop, len(new), req.longest) >= 0:
            reason = "stop_sequence"
        include = p.include_stop_str_in_output
        streamed = req.emitted
        if not include and not special:
            text = self._held_back(req, reason is not None)
        info = TokenInfo(tid, text, logprob, special)
        top = [self.token_info(t, lp) for t, lp in top_ids] if p.top_n_tokens else None
        event = GenerationEvent(token=info, top_tokens=top, generated_tokens=generated,
                                prompt_tokens=prompt_tokens)
        if reason is None:
            return event
        final_text = decode_keeping(self.tokenizer, req.ids, req.kept)
        if not include:
            cut = _find_stop(final_text, p.stop, len(final_text), req.longest) if p.stop else -1
            if cut >= 0:
                final_text = final_text[:cut]
            if not special and final_text.startswith(req.detok.text[:streamed]):
                # The last token carries everything up to the cut, so the streamed pieces
                # add up to generated_text.
                info = replace(info, text=final_text[streamed:])
        elif not special and final_text.startswith(req.detok.text):
            # Text held back for an incomplete character goes out with the last token,
            # so the streamed pieces add up to generated_text.
            info = replace(info, text=info.text + final_text[len(req.detok.text):])
        event.token = info
        event.finished = True
        event.finish_reason = reason
        event.generated_text = final_text
        event.seed = None if p.greedy else p.seed
        event.prefill = req.prefill
        event.prefill_top = req.prefill_top
        return event

    def _held_back(self, req: _Request, finishing: bool) -> str:
        """include_stop=False: the new text that cannot be part of a stop string."""
        seen = req.detok.text
        hold = 0 if finishing else req.tails.hold(seen)
        end = max(req.emitted, len(seen) - hold)
        text, req.emitted = seen[req.emitted:end], end
        return text


def _find_stop(text: str, stops: tuple[str, ...], new_chars: int, longest: int) -> int:
    """Start of the earliest stop string in `text` that could involve the last new_chars
    characters (earlier text was checked before), or -1. longest: the longest stop's length."""
    start = max(0, len(text) - new_chars - longest - 8)
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


class _StopTails:
    """For each stop string, how many characters at the end of the text may begin it, kept
    up to date as the text grows (Knuth-Morris-Pratt): a token costs its own characters plus
    at most one walk down a stop's failure table, not a test of every prefix of every stop."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.fails = [_failure(s) for s in stops]
        self.tails = [0] * len(stops)
        self.fed = 0  # characters of the text seen so far

    def hold(self, text: str) -> int:
        """The most characters at the end of `text` that may begin a stop string. `text`
        only grows between calls (it extends the text of the last call)."""
        new, self.fed = text[self.fed :], len(text)
        tails = self.tails
        for i, stop in enumerate(self.stops):
            tails[i] = _advance(tails[i], new, stop, self.fails[i])
        return max(tails, default=0)


def _failure(stop: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of stop[: i + 1] that ends it."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        c = stop[i]
        while k and stop[k] != c:
            k = fail[k - 1]
        if stop[k] == c:
            k += 1
        fail[i] = k
    return fail


def _advance(k: int, chars: str, stop: str, fail: list[int]) -> int:
    """Given k, the longest k < len(stop) such that some text ends with stop[:k], the same
    for text + chars. Only a proper prefix can be held back: a whole stop ends the request
    (and, were it fed on, counts as its longest proper prefix that ends it)."""
    if len(stop) < 2:
        return 0
    last = len(stop)
    for c in chars:
        while k and stop[k] != c:
            k = fail[k - 1]
        if stop[k] == c:
            k += 1
            if k == last:
                k = fail[k - 1]
    return k
