"""Tool calls in freely generated text (`tool_choice: "auto"`), in the formats chat templates
teach their models:

- `hermes` (Hermes, Qwen 2.5/3, and tpserve's own prompt for templates without tools):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, anywhere;
- `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` when that token is decoded as text), several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; `[TOOL_CALLS]` is a
  special token that the text usually lacks, so an answer that is a bare JSON array of
  calls counts too; newer Mistral templates (tokenizer v11+) write each call as
  `[TOOL_CALLS]name[ARGS]{...}`, which reads `name{...}` once both special tokens are left
  out of the text (an answer that is nothing but such calls of the request's tools);
- `pythonic` (Llama 3.2 / 4, some others): the whole answer is a Python list of calls with
  keyword arguments, `[get_weather(city="Paris"), get_time()]`, values Python literals.

`auto` (the server's default, --tool-call-parser) accepts all four. A call must name one of
the request's tools and carry an arguments object; text that is not such a call stays
content, so nothing the model wrote is lost.

ToolTextGate reads the text as it streams: content is released as it comes, except what
could be the start of a call (a partial `<tool_call>` or a reply opening with `{` or `[`),
which is held; from the start of a call on, the rest is read at the end.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection
from dataclasses import dataclass

PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def _call(obj: object, names: Collection[str]) -> ParsedCall | None:
    """obj as a call of one of `names`: {"name", "arguments" | "parameters"}, the arguments
    an object (or JSON text of one, as some models write them)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, seps: str) -> list[object] | None:
    """Every JSON value of `text`, separated by whitespace or `seps`; None unless the
    whole text is such values."""
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in seps):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = _decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _calls_of(values: list[object], names: Collection[str]) -> list[ParsedCall] | None:
    """The calls in decoded values (objects, or arrays of them); None unless all are calls."""
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(v, names) for v in flat]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _hermes(text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
    """Calls in <tool_call> blocks; a block that is not a call stays in the content."""
    content, calls, i = [], [], 0
    while (start := text.find(HERMES_OPEN, i)) >= 0:
        content.append(text[i:start])
        end = text.find(HERMES_CLOSE, start)
        stop = len(text) if end < 0 else end + len(HERMES_CLOSE)
        body = text[start + len(HERMES_OPEN): end if end >= 0 else len(text)]
        found = _calls_of(_json_values(body, "") or [], names)
        if found:
            calls += found
        else:
            content.append(text[start:stop])
        i = stop
    content.append(text[i:])
    return "".join(content), calls


def _mistral_named(after: str, names: Collection[str]) -> list[ParsedCall] | None:
    """Mistral's newer form, after the first [TOOL_CALLS]: `name[ARGS]{...}` per call, the
    calls separated by further [TOOL_CALLS] marks."""
    calls = []
    for part in after.split(MISTRAL_MARK):
        name, sep, args = part.partition(MISTRAL_ARGS)
        values = _json_values(args, "") if sep else None
        if not values or len(values) != 1:
            return None
        calls.append(_call({"name": name.strip(), "arguments": values[0]}, names))
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _mistral_bare(body: str, names: Collection[str]) -> list[ParsedCall] | None:
    """`name{...}name{...}`: Mistral v11's calls with [TOOL_CALLS] and [ARGS] (special
    tokens) left out of the text. Only an answer made of nothing else counts."""
    calls, i = [], 0
    by_length = sorted(names, key=len, reverse=True)  # get_weather_now before get_weather
    while i < len(body):
        name = next((n for n in by_length if body.startswith(n, i)), None)
        if name is None:
            return None
        i += len(name)
        while i < len(body) and body[i].isspace():
            i += 1
        try:
            args, i = _decoder.raw_decode(body, i)
        except ValueError:
            return None
        calls.append(_call({"name": name, "arguments": args}, names))
        while i < len(body) and body[i].isspace():
            i += 1
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _pythonic(body: str, names: Collection[str]) -> list[ParsedCall] | None:
    """`[f(a=1, b="x"), g()]`: a list of calls of known tools, keyword arguments only, each
    value a Python literal (read with ast, never evaluated as code)."""
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            return None
        try:  # a set or bytes value is no JSON: TypeError from the arguments' encoding
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(_call({"name": node.func.id, "arguments": args}, names))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return calls if all(calls) else None  # type: ignore[return-value]


def parse_calls(text: str, names: Collection[str], parser: str) -> tuple[str, list[ParsedCall]]:
    """(content left, calls) of `text`, which starts where a call may start: a marker, or
    the beginning of the answer. No calls: the text comes back whole as content."""
    if parser in ("auto", "hermes") and HERMES_OPEN in text:
        return _hermes(text, names)
    body = text.strip()
    if parser in ("auto", "mistral") and MISTRAL_MARK in body:
        before, _, after = body.partition(MISTRAL_MARK)
        calls = (_calls_of(_json_values(after, "") or [], names)
                 or _mistral_named(after, names))
        return (before, calls) if calls else (text, [])
    if parser in ("auto", "pythonic"):
        calls = _pythonic(body, names)
        if calls:
            return "", calls
    if parser in ("auto", "mistral"):
        calls = _mistral_bare(body, names)
        if calls:
            return "", calls
    if parser in ("auto", "llama3_json", "mistral"):
        if parser != "mistral" and body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        values = _json_values(body, ";" if parser != "mistral" else "")
        calls = _calls_of(values or [], names)
        if calls and (parser != "mistral" or isinstance(values[0], list)):
            return "", calls
    return text, []


def partial_marker(text: str, markers: Collection[str]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`: a
    stream holds them back until the next piece says whether the marker is there."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])),
               default=0)


class ToolTextGate:
    """Streams content and holds what may be a tool call; `finish` parses the held text."""

    def __init__(self, names: Collection[str], parser: str = "auto") -> None:
        self.names, self.parser = names, parser
        self.markers = [m for p, m in (("hermes", HERMES_OPEN), ("mistral", MISTRAL_MARK))
                        if parser in (p, "auto")]
        self.leads = {"hermes": [], "mistral": ["["], "pythonic": ["["]}.get(
            parser, ["{", "[", PYTHON_TAG])
        if parser in ("auto", "mistral"):  # Mistral v11 without its special tokens: name{...}
            self.leads = [*self.leads, *names]
        self.text = ""
        self.released = 0  # text[:released] went out as content
        self.call_at: int | None = None  # where held text that may be a call starts

    def feed(self, piece: str) -> str:
        """The content that can be released now."""
        self.text += piece
        if self.call_at is not None:
            return ""
        if self.released == 0 and self.leads:
            head = self.text.lstrip()
            if any(head.startswith(lead) for lead in self.leads):
                self.call_at = 0
                return ""
            if not head or any(lead.startswith(head) for lead in self.leads):
                return ""  # only whitespace, or a partial <|python_tag|> so far
        rest = self.text[self.released:]
        found = [i for i in (rest.find(m) for m in self.markers) if i >= 0]
        if found:
            self.call_at = self.released + min(found)
            return self._release(self.call_at)
        return self._release(len(self.text) - partial_marker(rest, self.markers))

    def _release(self, upto: int) -> str:
        out, self.released = self.text[self.released:upto], max(self.released, upto)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content still to send, calls): call-less held text is sent as content."""
        if self.call_at is None:
            return self._release(len(self.text)), []
        content, calls = parse_calls(self.text[self.call_at:], self.names, self.parser)
        self.released = len(self.text)
        return content, calls


def parse_tool_calls(text: str, names: Collection[str],
                     parser: str = "auto") -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's (content, calls), as a stream of it would give them; content is
    None when it is only whitespace next to calls."""
    gate = ToolTextGate(names, parser)
    content = gate.feed(text)
    tail, calls = gate.finish()
    content += tail
    return (None if calls and not content.strip() else content), calls
