"""A reasoning splitter fed in pieces, for the tests of each reasoning format."""

from __future__ import annotations

from tpserve.server.reasoning import Reasoning, ReasoningSplitter, Tags


def split_streamed(text: str, tags: Tags, inside: bool, size: int) -> tuple[str | None, str]:
    """(reasoning, content) of `text` fed `size` characters at a time, as split_reasoning
    answers for the whole text; reasoning is None when no block was opened."""
    splitter = ReasoningSplitter(tags, inside)
    pieces = []
    for i in range(0, len(text), size):
        pieces += splitter.feed(text[i:i + size])
    pieces += splitter.finish()
    assert all(p for p in pieces), pieces  # no empty pieces go out
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return (reasoning if splitter.opened else None), "".join(
        p for p in pieces if isinstance(p, str))
