"""A thinking model's reasoning split from its answer (`--reasoning-parser`).

A format is a pair of tags (FORMATS): `think`, `<think> ... </think>` (Qwen3, QwQ,
DeepSeek-R1 and its distills), `mistral`, `[THINK] ... [/THINK]` (Magistral, whose tags
are special tokens: server/reasoning_format.py has the engine keep their text), and
`harmony` (gpt-oss: its analysis channel, up to the final channel's header). Below, "open"
and "close" are the format's tags.

The reasoning is open from the first character when the rendered prompt ends with the open
tag (and whitespace): templates such as DeepSeek-R1's and Qwen3-Thinking's write it
themselves, so the answer starts inside it. Otherwise it opens only when the answer itself
starts with the open tag (after whitespace). Reading the prompt, rather than taking any
text before a first close tag as reasoning, lets a plain answer stream as content at once;
a close tag that nothing opened is left in the content.

The whitespace around the tags is dropped (the reasoning is stripped, the content loses
its leading whitespace); an answer with no reasoning block comes back as it was written.
ReasoningSplitter reads the text as it streams and holds back only what could still be a
tag (a partial open tag at the start, a partial close tag and the whitespace before it),
so the pieces of a stream add up to the split of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tpserve.server.tool_parsers import partial_marker


@dataclass(frozen=True)
class Tags:
    """The tags around a reasoning block. tokens: the vocabulary's tokens the tags are
    written with, where a tag is several of them (harmony's); empty: each tag is one token,
    or plain text. answer: the header of an answer that starts without reasoning, left out
    of its content."""

    open: str
    close: str
    tokens: tuple[str, ...] = ()
    # A header that opens an answer without reasoning (harmony's final channel): dropped.
    answer: str = ""

    def token_names(self) -> tuple[str, ...]:
        return self.tokens or (self.open, self.close)


# gpt-oss's harmony format: the answer is an analysis channel (the reasoning), ended by
# <|end|>, then a new assistant message on the final channel (the content). Its markers are
# special tokens, which the engine keeps in the text for the split.
HARMONY = Tags("<|channel|>analysis<|message|>",
               "<|end|><|start|>assistant<|channel|>final<|message|>",
               tokens=("<|channel|>", "<|message|>", "<|end|>", "<|start|>"),
               answer="<|channel|>final<|message|>")
FORMATS = {"think": Tags("<think>", "</think>"), "mistral": Tags("[THINK]", "[/THINK]"),
           "harmony": HARMONY}
# none: not split; auto: the format whose tags are tokens of the model's vocabulary.
PARSERS = ("none", *FORMATS, "auto")


def prompt_opens_reasoning(prompt: str, tags: Tags) -> bool:
    """Whether the template left the reasoning open for the model to write."""
    return prompt.rstrip().endswith(tags.open)


@dataclass(frozen=True)
class Reasoning:
    """A piece of reasoning text; a plain str piece is content."""

    text: str


Piece = Reasoning | str
# start: not yet known whether the answer opens with the open tag; reasoning: inside it;
# gap: after the close tag, before the content's first non-space character; content: the rest.
State = Literal["start", "reasoning", "gap", "content"]


class ReasoningSplitter:
    """One choice's text as reasoning and content pieces, in that order."""

    def __init__(self, tags: Tags, inside: bool) -> None:
        self.tags = tags
        self.text = ""
        self.released = 0  # text[:released] is sent (or dropped: tags and their spaces)
        self.state: State = "reasoning" if inside else "start"
        self.opened = inside  # a reasoning block was opened (by the prompt or the answer)
        self._reasoned = False  # some reasoning text went out (its leading space is dropped)

    def feed(self, piece: str) -> list[Piece]:
        """The pieces that can be released now."""
        self.text += piece
        out: list[Piece] = []
        if self.state == "start" and not self._start():
            return out
        if self.state == "reasoning":
            close = self.tags.close
            end = self.text.find(close, self.released)
            if end < 0:
                hold = partial_marker(self.text[self.released:], (close,))
                return self._reasoning(len(self.text) - hold)
            out = self._reasoning(end)
            self.state, self.released = "gap", end + len(close)
        if self.state == "gap":
            rest = self.text[self.released:]
            if not rest.strip():
                return out
            self.state, self.released = "content", len(self.text) - len(rest.lstrip())
        if self.released < len(self.text):
            out.append(self.text[self.released:])
            self.released = len(self.text)
        return out

    def finish(self) -> list[Piece]:
        """What is still held: a reasoning cut short ends as it is, without its trailing
        space; text that only began like the open tag is content."""
        rest = self.text[self.released:]
        self.released = len(self.text)
        if self.state == "reasoning":
            text = rest.strip() if not self._reasoned else rest.rstrip()
            return [Reasoning(text)] if text else []
        return [rest] if self.state == "start" and rest else []

    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def _start(self) -> bool:
        """Decides whether the answer opens a reasoning block; False while it cannot tell."""
        head, tag, answer = self.text.lstrip(), self.tags.open, self.tags.answer
        if head.startswith(tag):
            self.state, self.opened = "reasoning", True
            self.released = len(self.text) - len(head) + len(tag)
            return True
        if answer and head.startswith(answer):
            self.state, self.released = "content", len(self.text) - len(head) + len(answer)
            return True
        if not head or tag.startswith(head) or answer.startswith(head):
            return False
        self.state = "content"  # a plain answer: all of it, as written
        return True

    def _reasoning(self, upto: int) -> list[Piece]:
        """Reasoning text up to `upto`, less the space before it (it may end the reasoning)
        and, at its start, the space after the opening tag."""
        start = self.released
        if not self._reasoned:
            while start < upto and self.text[start].isspace():
                start += 1
        while upto > start and self.text[upto - 1].isspace():
            upto -= 1
        self.released = max(self.released, start)
        if upto <= start:
            return []
        self._reasoned, self.released = True, upto
        return [Reasoning(self.text[start:upto])]


def split_reasoning(text: str, tags: Tags, inside: bool) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content), as a stream of it would give them; reasoning
    is None when no block was opened."""
    splitter = ReasoningSplitter(tags, inside)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p for p in pieces if isinstance(p, str))
    return (reasoning if splitter.opened else None), content
