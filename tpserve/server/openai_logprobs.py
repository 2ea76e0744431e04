"""OpenAI's two log-probability formats, built from the engine's tokens (TokenInfo).

Chat (`logprobs: true`, `top_logprobs: k`): per generated token
`{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}` under
`choices[i].logprobs.content`. Legacy completions (`logprobs: k`): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (a dict per token: the k likeliest, and the chosen token,
as OpenAI always adds it) and `text_offset` (where each token starts in the returned text).

Each entry names the token itself (`text_of`: its own decoded text, as its alternatives are
named), not the piece of text the stream released with it: that piece is empty while a
stop string or an incomplete character holds text back, and carries several tokens' text
after. The legacy format has no `bytes`: a token holding part of a multi-byte character is
named by its bytes there (legacy_name). Special tokens (the end-of-sequence token) are left
out: they are not part of the returned text either. The numbers are the model's own
log-probabilities (SamplingParams.raw_logprobs), as OpenAI and vLLM report them: temperature,
top_p, penalties and biases change which token is drawn, not what it reports. With `echo`,
the prompt's tokens come first: their log-probabilities (and alternatives) are what the
model gave each prompt token after the ones before it; the first has none (null), as in
OpenAI's answers.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable
from typing import Any

from tpserve.engine.request import GenerationEvent, TokenInfo

# A generated token -> its own text (the backend's decode of its id).
TokenText = Callable[[TokenInfo], str]
# A token and its own text -> the bytes it stands for (OpenAI's `bytes`: a piece of a
# multi-byte character reads U+FFFD as text, and its own bytes here).
TokenBytes = Callable[[TokenInfo, str], list[int]]


def streamed_text(tok: TokenInfo) -> str:
    """For a backend that cannot decode: the text the engine sent with the token."""
    return tok.text


def _utf8(tok: TokenInfo, text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_entry(tok: TokenInfo, top: list[TokenInfo] | None, k: int,
               text_of: TokenText = streamed_text,
               bytes_of: TokenBytes = _utf8) -> dict[str, Any]:
    text = text_of(tok)
    return {
        "token": text,
        "logprob": tok.logprob,
        "bytes": bytes_of(tok, text),
        "top_logprobs": [
            {"token": t.text, "logprob": t.logprob, "bytes": bytes_of(t, t.text)}
            for t in (top or [])[:k]
        ],
    }


def chat_logprobs(events: Iterable[GenerationEvent], k: int,
                  text_of: TokenText = streamed_text,
                  bytes_of: TokenBytes = _utf8) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat answer (or of one chunk: pass its events)."""
    return {
        "content": [chat_entry(e.token, e.top_tokens, k, text_of, bytes_of)
                    for e in events if not e.token.special],
        "refusal": None,
    }


def legacy_name(text: str, raw: bytes) -> str:
    """A token's name in the legacy format, whose `tokens` and `top_logprobs` keys are
    strings with no `bytes` beside them: its own text, unless the token holds bytes that are
    not whole UTF-8 characters (a piece of a multi-byte character, whose text reads U+FFFD
    however many bytes it holds): then its bytes, those that are not characters written
    `\\xNN`, as OpenAI spells such a token ("\\xe4\\xbd")."""
    if "\ufffd" not in text:
        return text
    return raw.decode("utf-8", "backslashreplace")


class CompletionLogprobs:
    """`choices[i].logprobs` of a legacy completion, token by token. `offset` is where the
    next token starts in the choice's text (after an echoed prompt, its length). It advances
    by the characters each token's bytes complete: a token holding part of a character
    starts where that character does, and the character counts once, when its last byte
    comes (one U+FFFD each took a place in the text it does not have).

    Two tokens of the same name (two ids that decode alike) would overwrite each other's
    `top_logprobs` entry: the chosen token keeps its name, then the likelier alternative;
    another is listed as `token_id:<id>` (vLLM's spelling of a token by its id)."""

    def __init__(self, k: int, offset: int = 0, text_of: TokenText = streamed_text,
                 bytes_of: TokenBytes = _utf8) -> None:
        self.k, self.offset, self.text_of, self.bytes_of = k, offset, text_of, bytes_of
        self._chars = codecs.getincrementaldecoder("utf-8")("replace")
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float | None] | None] = []
        self.text_offset: list[int] = []

    def _named(self, tok: TokenInfo, text: str) -> tuple[str, bytes]:
        """The token's legacy name and the bytes it stands for."""
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        raw = bytes(self.bytes_of(tok, text))
        return legacy_name(text, raw), raw

    def _ranked(self, top: list[TokenInfo], tok: TokenInfo, name: str) -> dict:
        """The k likeliest alternatives by name, and the chosen token under `name`."""
        owner = {name: tok.id}
        ranked: dict[str, float | None] = {}
        for alt in top[: self.k]:
            alt_name = self._named(alt, alt.text)[0]
            if owner.setdefault(alt_name, alt.id) != alt.id:
                alt_name = f"token_id:{alt.id}"
            ranked[alt_name] = alt.logprob
        ranked.setdefault(name, tok.logprob)
        return ranked

    def add(self, tok: TokenInfo, top: list[TokenInfo] | None) -> None:
        """A generated token and its ranked alternatives."""
        if tok.special:
            return
        name, raw = self._named(tok, self.text_of(tok))
        self._append(name, tok.logprob, self._ranked(top or [], tok, name), raw)

    def add_prompt(self, prompt: list[TokenInfo], text: str,
                   tops: list[list[TokenInfo]] | None = None) -> None:
        """The echoed prompt's tokens (the engine's prefill) and their alternatives, which
        fill `text` from 0; the generated tokens start after `text`."""
        self.offset = 0
        for i, tok in enumerate(prompt):
            name, raw = self._named(tok, tok.text)
            ranked = None
            if tops is not None and i > 0 and tok.logprob is not None:
                ranked = self._ranked(tops[i], tok, name)
            # A special token (BOS) takes room only where the echoed text spells it: a
            # decoded token-id prompt does, a prompt sent as text does not.
            here = not tok.special or text.startswith(tok.text, self.offset)
            self._append(name, tok.logprob, ranked, raw if here else b"")
        self.offset = len(text)
        self._chars.reset()

    def _append(self, name: str, logprob: float | None, ranked: dict | None,
                raw: bytes) -> None:
        self.tokens.append(name)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(ranked)
        self.text_offset.append(self.offset)
        self.offset += len(self._chars.decode(raw))

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict[str, Any] | None:
        """What was added since the last take (one stream chunk's), or None if nothing."""
        if not self.tokens:
            return None
        out = self.body()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
