"""Incremental detokenization: text for each new token without re-decoding the whole output.

Decoding a token alone loses context (leading spaces, multi-byte characters split over
tokens), so each step decodes a short window ending at the new token and emits only what
the window adds; an incomplete UTF-8 character (U+FFFD) waits for the next token.

Special tokens are left out of the text, except those a request keeps (`add_kept`): their
own text goes in, and decoding starts over after them, so the text is each stretch between
kept tokens decoded alone, joined by the kept tokens' texts (`decode_keeping`, the whole
answer's text, is the same by construction).
"""

from __future__ import annotations


def _native_stream(tokenizer):
    """The tokenizers library's own incremental decoder for a fast tokenizer (Rust, several
    times cheaper per token than two Python-level decodes), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return backend, DecodeStream(skip_special_tokens=True)


def decode_keeping(tokenizer, ids: list[int], kept: frozenset[int]) -> str:
    """`ids` as text, special tokens left out but those in `kept`, as the incremental
    detokenizer gives it."""
    if not kept or kept.isdisjoint(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    parts, start = [], 0
    for i, token_id in enumerate(ids):
        if token_id in kept:
            parts.append(tokenizer.decode(ids[start:i], skip_special_tokens=True))
            parts.append(tokenizer.decode([token_id], skip_special_tokens=False))
            start = i + 1
    parts.append(tokenizer.decode(ids[start:], skip_special_tokens=True))
    return "".join(parts)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, special_ids: frozenset[int] = frozenset()) -> None:
        self.tok = tokenizer
        self.special_ids = special_ids
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self._start = 0  # where the stretch decoded from self.ids begins in self.text
        self._stream = _native_stream(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (may be empty)."""
        if token_id in self.special_ids:
            return ""
        self.ids.append(token_id)
        if self._stream is not None:
            backend, stream = self._stream
            try:
                new = stream.step(backend, token_id) or ""
            except Exception:  # tokenizers raises a bare Exception
                # DecodeStream refuses a window whose decoded start changed: byte-fallback
                # tokens (Llama, Mistral, Gemma) that join an earlier byte into an invalid
                # UTF-8 run decode it as U+FFFD. The windows below never raise; go on there.
                self._stream = None
            else:
                if new:
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.text += new
                return new
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def add_kept(self, token_id: int) -> str:
        """Append a special token whose text the request keeps; return the text it adds:
        what was held back of the stretch before it, then its own."""
        held = self.flush()
        own = self.tok.decode([token_id], skip_special_tokens=False)
        self.ids, self.prefix_offset, self.read_offset = [], 0, 0
        self._stream = _native_stream(self.tok)
        self.text += own
        self._start = len(self.text)
        return held + own

    def flush(self) -> str:
        """At the end of generation: whatever text is still held back."""
        full = self._decode(self.ids)
        done = self.text[self._start:]
        if full.startswith(done) and len(full) > len(done):
            rest = full[len(done):]
            self.text += rest
            return rest
        return ""
