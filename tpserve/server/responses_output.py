"""The `output` of a Responses API answer, built from its text and tool-call deltas
(server/tool_stream.py), with the stream events that build it on the client.

One OutputBuilder serves both a stream and a whole answer (which ignores the events), so
they cannot differ. Items open when their first piece comes and close when the next item
opens or the answer ends: a `reasoning` item holds one `reasoning_text` part (and an empty
`summary`: tpserve writes none), a `message` one `output_text` part, a `function_call` its
arguments. An answer with no message or call gets an empty message, so `output_text` is
always there.
Event payloads carry no `sequence_number`: the stream numbers them as it sends them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tpserve.server.reasoning import Reasoning
from tpserve.server.tool_stream import CallDelta, Delta

Event = dict[str, Any]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
Kind = Literal["message", "function_call", "reasoning"]
# The part a text item holds, and the prefix of its stream events.
_TEXT = {"message": ("output_text", "response.output_text"),
         "reasoning": ("reasoning_text", "response.reasoning_text")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Item:
    kind: Kind
    id: str
    index: int  # output_index
    text: str = ""  # the message's or reasoning's text, or the call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: ItemStatus = "in_progress"

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": self.logprobs}

    def wire(self, opening: bool = False) -> dict[str, Any]:
        """The item as `output` lists it (opening: as output_item.added announces it)."""
        if self.kind == "message":
            return {"id": self.id, "type": "message", "status": self.status,
                    "role": "assistant", "content": [] if opening else [self.part()]}
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [],
                    "content": [] if opening else [self.part()]}
        return {"id": self.id, "type": "function_call", "status": self.status,
                "call_id": self.call_id, "name": self.name, "arguments": self.text}


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[Item] = []
        self._open: Item | None = None
        self._calls: dict[int, Item] = {}  # a CallDelta's index -> its item
        self._pending: list[dict[str, Any]] = []  # log-probabilities of text not yet out

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]] | None = None
             ) -> list[Event]:
        """Events for new deltas. `logprobs`: the entries of the tokens that released them.
        They go with the next text: a token may hold its text back (a stop sequence could
        be forming, or a tool call), and a call's tokens report none."""
        self._pending += logprobs or []
        events: list[Event] = []
        for d in deltas:
            if isinstance(d, CallDelta):
                events += self._call(d)
            elif isinstance(d, Reasoning):
                # The Responses types give reasoning text no log-probabilities: its
                # tokens' entries are dropped rather than given to the answer's text.
                self._pending = []
                events += self._text(d.text, "reasoning")
            elif d:
                events += self._text(d)
        return events

    def finish(self, status: ItemStatus) -> list[Event]:
        """The closing events; `status` is the last item's (incomplete: cut by length)."""
        answered = any(item.kind != "reasoning" for item in self.items)
        events = [] if answered else self._close("completed") + self._open_text("message")
        if self._pending and self._open is not None and self._open.kind == "message":
            events += self._text("")
        return events + self._close(status)

    def output(self) -> list[dict[str, Any]]:
        return [item.wire() for item in self.items]

    def _text(self, piece: str, kind: Kind = "message") -> list[Event]:
        events = []
        if self._open is None or self._open.kind != kind:
            events = self._close("completed") + self._open_text(kind)
        item = self._open
        item.text += piece
        delta = {"type": f"{_TEXT[kind][1]}.delta", **_at(item), "content_index": 0,
                 "delta": piece}
        if kind == "message":
            item.logprobs += self._pending
            delta["logprobs"], self._pending = self._pending, []
        return events + [delta]

    def _call(self, d: CallDelta) -> list[Event]:
        events = []
        if d.id is not None:
            events = self._close("completed")
            item = self._new("function_call", new_id("fc"))
            item.call_id, item.name = d.id, d.name or ""
            self._calls[d.index] = item
            events.append({"type": "response.output_item.added", "output_index": item.index,
                           "item": item.wire(opening=True)})
        item = self._calls[d.index]
        if d.arguments:
            item.text += d.arguments
            events.append({"type": "response.function_call_arguments.delta", **_at(item),
                           "delta": d.arguments})
        return events

    def _new(self, kind: Kind, item_id: str) -> Item:
        item = Item(kind, item_id, len(self.items))
        self.items.append(item)
        self._open = item
        return item

    def _open_text(self, kind: Kind) -> list[Event]:
        item = self._new(kind, new_id("msg" if kind == "message" else "rs"))
        empty = {**item.part(), "text": ""} | ({"logprobs": []} if kind == "message" else {})
        return [{"type": "response.output_item.added", "output_index": item.index,
                 "item": item.wire(opening=True)},
                {"type": "response.content_part.added", **_at(item), "content_index": 0,
                 "part": empty}]

    def _close(self, status: ItemStatus) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        done = {"type": "response.output_item.done", "output_index": item.index,
                "item": item.wire()}
        if item.kind == "function_call":
            return [{"type": "response.function_call_arguments.done", **_at(item),
                     "arguments": item.text}, done]
        text_done = {"type": f"{_TEXT[item.kind][1]}.done", **_at(item), "content_index": 0,
                     "text": item.text}
        if item.kind == "message":
            text_done["logprobs"] = item.logprobs
        return [text_done, {"type": "response.content_part.done", **_at(item),
                            "content_index": 0, "part": item.part()}, done]


def _at(item: Item) -> dict[str, Any]:
    return {"item_id": item.id, "output_index": item.index}
