"""OpenAI's two log-probability formats, built from the engine's tokens (TokenInfo).

Chat (`logprobs: true`, `top_logprobs: k`): per generated token
`{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}` under
`choices[i].logprobs.content`. Legacy completions (`logprobs: k`): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (a dict per token: the k likeliest, and the chosen token,
as OpenAI always adds it) and `text_offset` (where each token starts in the returned text).

Each entry names the token itself (`text_of`: its own decoded text, as its alternatives are
named), not the piece of text the stream released with it: that piece is empty while a
stop string or an incomplete character holds text back, and carries several tokens' text
after. Special tokens (the end-of-sequence token) are left out: they are not part of the
returned text either. The numbers are the model's own log-probabilities
(SamplingParams.raw_logprobs), as OpenAI and vLLM report them: temperature, top_p, penalties
and biases change which token is drawn, not what it reports. With `echo`, the prompt's
tokens come first: their log-probabilities (and alternatives) are what the model gave each
prompt token after the ones before it; the first has none (null), as in OpenAI's answers.
"""

from __future__ import annotations

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


class CompletionLogprobs:
    """`choices[i].logprobs` of a legacy completion, token by token. `offset` is where the
    next token starts in the choice's text (after an echoed prompt, its length); it advances
    by each token's own text, as vLLM counts it."""

    def __init__(self, k: int, offset: int = 0, text_of: TokenText = streamed_text) -> None:
        self.k, self.offset, self.text_of = k, offset, text_of
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float | None] | None] = []
        self.text_offset: list[int] = []

    def add(self, tok: TokenInfo, top: list[TokenInfo] | None) -> None:
        """A generated token and its ranked alternatives."""
        if tok.special:
            return
        own = TokenInfo(tok.id, self.text_of(tok), tok.logprob, tok.special)
        ranked = {t.text: t.logprob for t in (top or [])[: self.k]}
        ranked.setdefault(own.text, own.logprob)
        self._append(own, ranked)

    def add_prompt(self, prompt: list[TokenInfo], text: str,
                   tops: list[list[TokenInfo]] | None = None) -> None:
        """The echoed prompt's tokens (the engine's prefill) and their alternatives, which
        fill `text` from 0; the generated tokens start after `text`."""
        self.offset = 0
        for i, tok in enumerate(prompt):
            ranked = None
            if tops is not None and i > 0 and tok.logprob is not None:
                ranked = {t.text: t.logprob for t in tops[i][: self.k]}
                ranked.setdefault(tok.text, tok.logprob)
            # A special token (BOS) takes room only where the echoed text spells it: a
            # decoded token-id prompt does, a prompt sent as text does not.
            here = not tok.special or text.startswith(tok.text, self.offset)
            self._append(tok, ranked, advance=here)
        self.offset = len(text)

    def _append(self, tok: TokenInfo, ranked: dict | None, advance: bool = True) -> None:
        self.tokens.append(tok.text)
        self.token_logprobs.append(tok.logprob)
        self.top_logprobs.append(ranked)
        self.text_offset.append(self.offset)
        if advance:
            self.offset += len(tok.text)

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
