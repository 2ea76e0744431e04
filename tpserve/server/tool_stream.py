"""A chat choice's generated text turned into content and tool calls, piece by piece, so a
stream and a whole answer give the same result: one ChoiceTools per choice, fed the text as
it comes (`feed`), then `finish`.

Forced choices are constrained JSON (server/tools.py): a named function's text is its
arguments, and `required`'s text is `[{"name": ..., "arguments": {...}}, ...]`, read by a
small scanner that announces each call once its name is complete and streams its
arguments' text as it grows. `auto` text goes through ToolTextGate (server/tool_parsers.py):
its calls come whole at the end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tpserve.server.reasoning import Reasoning
from tpserve.server.tool_parsers import ToolTextGate
from tpserve.server.tools import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """A piece of call `index`: its id and name come on its first piece only."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


Delta = str | CallDelta | Reasoning  # a str is content (Reasoning: server/choice_reader.py)


@dataclass
class _Call:
    name: str | None = None
    start: int | None = None  # where its arguments' text starts and ends in the scanned text
    end: int | None = None
    sent: int = 0  # characters of its arguments sent
    id: str | None = None


@dataclass
class CallArrayScanner:
    """Reads `[{"name": ..., "arguments": ...}, ...]` one character at a time: tracks the
    container stack and strings, the current key of each call object, and where each call's
    arguments value starts and ends."""

    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    _pos: int = 0
    _stack: list[str] = field(default_factory=list)
    _in_str: bool = False
    _esc: bool = False
    _str_start: int = 0
    _key: str | None = None
    _colon: bool = False
    _in_value: bool = False

    def feed(self, piece: str) -> None:
        self.text += piece
        while self._pos < len(self.text):
            self._step(self.text[self._pos])
            self._pos += 1

    def _step(self, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                self._string_end()
            return
        at_call = len(self._stack) == 2  # inside a call object: [ { here } ]
        if at_call and self._colon and not c.isspace():
            self._colon, self._in_value = False, True
            if self._key == "arguments":
                self.calls[-1].start = self._pos
        if c == '"':
            self._in_str, self._str_start = True, self._pos
        elif c in "{[":
            self._stack.append(c)
            if len(self._stack) == 2:
                self.calls.append(_Call())
                self._key, self._in_value = None, False
        elif c in "}]" and self._stack:
            if at_call:
                self._value_end()
            self._stack.pop()
            if len(self._stack) == 2 and self._key == "arguments" and self.calls[-1].end is None:
                self.calls[-1].end = self._pos + 1  # the arguments object closed
        elif at_call and c == ":":
            self._colon = True
        elif at_call and c == ",":
            self._value_end()
            self._key, self._in_value = None, False

    def _value_end(self) -> None:
        call = self.calls[-1]
        if self._key == "arguments" and call.start is not None and call.end is None:
            call.end = self._pos

    def _string_end(self) -> None:
        if len(self._stack) != 2:
            return
        try:
            value = json.loads(self.text[self._str_start:self._pos + 1])
        except ValueError:
            return
        if not self._in_value:
            self._key = value
        elif self._key == "name":
            self.calls[-1].name = value

    def arguments(self, call: _Call) -> str:
        if call.start is None:
            return ""
        return self.text[call.start:call.end if call.end is not None else len(self.text)]


class ChoiceTools:
    """One choice's text as deltas; `finish` also gives the choice's finish_reason."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.scanner = CallArrayScanner() if plan.mode == "required" else None
        self.gate = ToolTextGate(plan.names, parser) if plan.mode == "auto" else None
        self.named = _Call(name=plan.named, start=0) if plan.mode == "named" else None
        self.text = ""
        self.called = False

    def feed(self, piece: str) -> list[Delta]:
        if self.gate is not None:
            out = self.gate.feed(piece)
            return [out] if out else []
        if self.scanner is not None:
            self.scanner.feed(piece)
            return [d for i, c in enumerate(self.scanner.calls) if (d := self._send(i, c))]
        self.text += piece
        args = self.text.lstrip()  # the grammar may open with whitespace
        self.named.start = len(self.text) - len(args)
        delta = self._send(0, self.named) if args else None
        return [delta] if delta else []

    def _send(self, index: int, call: _Call) -> CallDelta | None:
        """What is new of a call whose name is known: its name (once) and arguments."""
        if call.name is None:
            return None
        text = self.text if self.scanner is None else self.scanner.text
        end = call.end if call.end is not None else len(text)
        new = text[call.start + call.sent:end] if call.start is not None else ""
        first = call.id is None
        if not first and not new:
            return None
        call.sent += len(new)
        self.called = True
        if first:
            call.id = call_id()
            return CallDelta(index, new, call.name, call.id)
        return CallDelta(index, new)

    def finish(self, piece: str, reason: str) -> tuple[list[Delta], str]:
        """The last deltas and the finish reason: `tool_calls` for a choice that called a
        function and ended on its own (`length` stays: its arguments may be cut short)."""
        out = self.feed(piece)
        if self.gate is not None:
            content, calls = self.gate.finish()
            out += [content] if content else []
            out += [CallDelta(i, c.arguments, c.name, call_id()) for i, c in enumerate(calls)]
            self.called = bool(calls)
        elif not self.called:  # a forced call cut short before its name: the text as it is
            text = self.scanner.text if self.scanner is not None else self.text
            out += [text] if text else []
        return out, ("tool_calls" if self.called and reason == "stop" else reason)


def message_of(deltas: list[Delta]) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, tool_calls) from its deltas; content is None when the
    answer is only calls (and whitespace)."""
    content = "".join(d for d in deltas if isinstance(d, str))
    calls: dict[int, dict] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                calls[d.index] = {"id": d.id, "type": "function",
                                  "function": {"name": d.name, "arguments": ""}}
            calls[d.index]["function"]["arguments"] += d.arguments
    if calls and not content.strip():
        return None, list(calls.values())
    return content, list(calls.values())


def wire_delta(d: Delta, tgi: bool) -> dict:
    """A delta as the chunk's `delta`. OpenAI's tool_calls is a list of pieces; the
    text_generation client (0.7.0) reads it as one object with every key present. Reasoning
    goes in both spellings clients read (server/openai.py's message says which)."""
    if isinstance(d, Reasoning):
        return {"role": "assistant", "content": None, "reasoning_content": d.text,
                "reasoning": d.text, "tool_calls": None}
    if isinstance(d, str):
        return {"role": "assistant", "content": d, "tool_calls": None}
    fn: dict = {"arguments": d.arguments}
    piece: dict = {"index": d.index, "function": fn}
    if d.id is not None:
        piece.update(id=d.id, type="function")
        fn["name"] = d.name
    if tgi:
        piece = {"index": d.index, "id": d.id or "", "type": "function",
                 "function": {"name": d.name, "arguments": d.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": piece}
    return {"role": "assistant", "content": None, "tool_calls": [piece]}
