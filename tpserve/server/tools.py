"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` (OpenAI's and
TGI's spellings), checked and turned into a ToolPlan: what the chat template is given, and
what constrains or is parsed out of the generated text.

- `none`: tools reach the template (the model knows them), no call is returned.
- `auto` (the default with tools): free generation; calls are parsed out of the text
  (server/tool_parsers.py), anything else stays content.
- `required`: decoding is constrained (llguidance) to a JSON array of
  {"name": <one of the tools>, "arguments": <its parameters' schema>}, one item when
  `parallel_tool_calls` is false.
- a named function: decoding is constrained to that function's arguments object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from tpserve.engine.request import GuidedSpec
from tpserve.errors import ValidationError
from tpserve.fields import Text

Mode = Literal["none", "auto", "required", "named"]
# OpenAI's rule for function names, plus dots (TGI and MCP servers use dotted names).
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
CHOICE_HELP = ('"none", "auto", "required", a function name, or {"type": "function", '
               '"function": {"name": ...}}')


class FunctionDef(BaseModel):
    name: Text
    description: Text | None = None
    # A JSON schema of the arguments object (checked in plan_tools, where the index is known).
    parameters: Any = None
    strict: bool | None = None  # accepted; forced choices always enforce the schema


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionCallIn(BaseModel):
    name: Text
    # OpenAI sends JSON text; TGI 2 answered (and its users send back) an object.
    arguments: Text | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A call in an assistant turn of the conversation (one the model made earlier)."""

    id: Text | int | None = None  # TGI 2 numbered its calls
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def for_template(self) -> dict[str, Any]:
        """As chat templates take it: `arguments` an object where the text is one (Llama's
        and most templates write it with `tojson`, which would quote JSON text again)."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        call: dict[str, Any] = {"type": "function",
                                "function": {"name": self.function.name, "arguments": args}}
        if self.id is not None:
            call["id"] = str(self.id)
        return call


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: tuple[Tool, ...]
    named: str | None = None
    guided: GuidedSpec | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.function.name for t in self.tools)

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.for_template() for t in self.tools]

    @property
    def returns_calls(self) -> bool:
        return self.mode != "none"


def arguments_schema(params: Any, where: str) -> dict[str, Any]:
    """The schema of a function's arguments object; ValidationError when `params` is not a
    JSON schema of an object. A schema without `type` gets "object" (arguments are always
    an object); omitted parameters mean a function without arguments, as OpenAI reads it."""
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValidationError(f"`{where}` must be a JSON schema (an object), got "
                              f"{type(params).__name__}")
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValidationError(f"`{where}` must describe a JSON object (`\"type\": \"object\"`): "
                              f"a function's arguments are an object (got type {kind!r})")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict | bool) for v in props.values()):
        raise ValidationError(f"`{where}.properties` must map each argument name to a JSON "
                              "schema (an object)")
    for name, sub in props.items():
        if isinstance(sub, dict) and not _valid_type(sub.get("type")):
            raise ValidationError(f"`{where}.properties.{name}.type` must be one of "
                                  f"{sorted(_JSON_TYPES)} or a list of them "
                                  f"(got {sub.get('type')!r})")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValidationError(f"`{where}.required` must be a list of argument names")
    return {**params, "type": "object"}


def _valid_type(kind: Any) -> bool:
    if kind is None or isinstance(kind, str) and kind in _JSON_TYPES:
        return True
    return isinstance(kind, list) and all(isinstance(k, str) and k in _JSON_TYPES for k in kind)


def _choice(tool_choice: Any, names: tuple[str, ...]) -> tuple[Mode, str | None]:
    """(mode, named function) of `tool_choice`: OpenAI's strings and object, or TGI's bare
    function name."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice in ("none", "auto", "required"):
            return tool_choice, None
        name = tool_choice  # TGI's client sends the function's name as the whole value
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and tool_choice.get("type", "function") == "function":
        name = tool_choice["function"].get("name")
        if not isinstance(name, str):
            raise ValidationError("`tool_choice.function.name` must be a string")
    else:
        raise ValidationError(f"`tool_choice` must be {CHOICE_HELP} (got "
                              f"{json.dumps(tool_choice)[:100]})")
    if name not in names:
        listed = ", ".join(names) or "none: the request has no `tools`"
        raise ValidationError(f"`tool_choice` names the function `{name[:64]}`, which is not "
                              f"in `tools` (functions: {listed})")
    return "named", name


def _required_schema(tools: tuple[Tool, ...], schemas: list[dict], parallel: bool) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "arguments": s},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t, s in zip(tools, schemas, strict=True)]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1
                              else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(tools: list[Tool] | None, tool_choice: Any, parallel: bool | None,
               guided: GuidedSpec | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools and tool_choice); ValidationError (422)
    for a tool_choice without tools or naming an unknown function, duplicate or malformed
    names, parameters that are not an object's JSON schema, and a `response_format` that
    would fight a forced call."""
    tools = tuple(tools or ())
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValidationError("`tool_choice` needs `tools`: list the functions the model "
                                  "may call, or leave `tool_choice` out")
        return None
    seen: set[str] = set()
    schemas = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise ValidationError(f"`tools[{i}].function.name` must be 1 to 64 letters, digits, "
                                  f"underscores, dots or dashes (got {name[:80]!r})")
        if name in seen:
            raise ValidationError(f"`tools[{i}].function.name`: `{name}` is listed twice; "
                                  "function names must be unique")
        seen.add(name)
        schemas.append(arguments_schema(tool.function.parameters,
                                        f"tools[{i}].function.parameters"))
    names = tuple(t.function.name for t in tools)
    mode, named = _choice(tool_choice, names)
    if mode in ("required", "named") and guided is not None:
        raise ValidationError("`response_format` cannot be combined with a `tool_choice` that "
                              "forces a call (the call's arguments follow the function's "
                              "schema): drop one of them")
    spec = None
    if mode == "named":
        i = names.index(named)
        spec = GuidedSpec("json_schema", _compact(schemas[i]), f"tools[{i}].function.parameters")
    elif mode == "required":
        spec = GuidedSpec("json_schema",
                          _compact(_required_schema(tools, schemas, parallel is not False)),
                          "tools")
    return ToolPlan(mode, tools, named, spec)


def _compact(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
