"""A chat choice's generated text as deltas: its reasoning (server/reasoning.py) first, then
the answer, read for tool calls when the request may return some (server/tool_stream.py).
Calls are read from the answer only: a `<tool_call>` the model wrote while reasoning stays
in the reasoning. Fed as it streams (`feed`, one generated token's text at a time), then
`finish`; a whole answer is the same with one `finish`.
"""

from __future__ import annotations

from tpserve.server.reasoning import Reasoning, ReasoningSplitter
from tpserve.server.tool_stream import ChoiceTools, Delta
from tpserve.server.tools import ToolPlan


class ChoiceReader:
    def __init__(self, plan: ToolPlan | None, tool_parser: str,
                 splitter: ReasoningSplitter | None) -> None:
        calls = plan is not None and plan.returns_calls
        self.tools = ChoiceTools(plan, tool_parser) if calls else None
        self.splitter = splitter
        # Generated tokens that carried reasoning (a stream feeds one token at a time),
        # the tags included: the Responses API's usage.output_tokens_details.
        self.reasoning_tokens = 0

    def feed(self, piece: str) -> list[Delta]:
        return self._answer(self._split(piece, final=False))

    def finish(self, piece: str, reason: str) -> tuple[list[Delta], str]:
        """The last deltas and the finish reason (`tool_calls` for a choice that called)."""
        deltas = self._split(piece, final=True)
        reasoning = [d for d in deltas if isinstance(d, Reasoning)]
        answer = "".join(d for d in deltas if isinstance(d, str))
        if self.tools is None:
            return reasoning + ([answer] if answer else []), reason
        found, reason = self.tools.finish(answer, reason)
        return reasoning + found, reason

    def _split(self, piece: str, final: bool) -> list[Reasoning | str]:
        if self.splitter is None:
            return [piece] if piece or not final else []
        before = self.splitter.in_reasoning()
        pieces = self.splitter.feed(piece) + (self.splitter.finish() if final else [])
        if piece and (before or self.splitter.in_reasoning()):
            self.reasoning_tokens += 1
        return pieces

    def _answer(self, pieces: list[Reasoning | str]) -> list[Delta]:
        """Reasoning pieces as they are; the answer's text through the tool-call reader."""
        out: list[Delta] = [p for p in pieces if isinstance(p, Reasoning)]
        answer = "".join(p for p in pieces if isinstance(p, str))
        if self.tools is None:
            return out + ([answer] if answer else [])
        return out + self.tools.feed(answer)


def reasoning_of(deltas: list[Delta]) -> str | None:
    """A whole answer's reasoning text; None when it wrote none."""
    text = "".join(d.text for d in deltas if isinstance(d, Reasoning))
    return text or None
