"""Input items and function tools of a Responses API request, and their chat equivalents
(server/openai.py's ChatMessage and server/tools.py's Tool): messages keep their role
(`developer` is read as `system`, which is what it means to OpenAI's models and what chat
templates know), `function_call` items become the `tool_calls` of an assistant turn (joined
to the assistant message right before them: one turn that wrote text, then called),
`function_call_output` items `tool` turns, and flat function tools chat's nested ones.
`reasoning` items (an earlier answer's, sent back as OpenAI asks) are taken and dropped
when --reasoning-parser makes them: thinking models' templates leave earlier turns'
reasoning out of the prompt. Anything else (images, files, built-in tools) is a 422
naming it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict

from tpserve.errors import ValidationError
from tpserve.fields import FailFast, Text
from tpserve.server.openai import ChatMessage
from tpserve.server.tools import FunctionCallIn, FunctionDef, Tool, ToolCallIn

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served (checked in add_item)."""

    model_config = ConfigDict(extra="ignore")  # annotations, logprobs of earlier outputs
    type: Text
    text: Text | None = None
    refusal: Text | None = None


Content = Text | Annotated[list[ContentPart], FailFast]


class InputItem(BaseModel):
    """One item of `input`: a message (the default type), a `function_call` the model made
    earlier, or a `function_call_output` answering it. Statuses of earlier output items are
    accepted and not needed."""

    model_config = ConfigDict(extra="ignore")
    type: Text = "message"
    id: Text | None = None  # kept when the response is stored (a new one when absent)
    role: Text | None = None
    content: Content | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Content | None = None


class FunctionTool(BaseModel):
    """A Responses function tool (flat); other types are built-in tools, refused in chat_tools."""

    model_config = ConfigDict(extra="ignore")
    type: Text
    name: Text | None = None
    description: Text | None = None
    parameters: Any = None
    strict: bool | None = None


def _text(content: Content | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        else:
            raise ValidationError(f"`{where}[{j}].type` is {part.type[:40]!r}: tpserve serves "
                                  "text models and takes only text parts (input_text, "
                                  "output_text)")
    return "".join(texts)


def add_item(messages: list[ChatMessage], item: InputItem, where: str,
             reasoning_items: bool = False) -> None:
    if item.type == "reasoning" and reasoning_items:
        return
    if item.type == "message":
        role = _ROLES.get(item.role or "")
        if role is None:
            raise ValidationError(f"`{where}.role` must be user, assistant, system or "
                                  f"developer (got {item.role!r})")
        messages.append(ChatMessage(role=role, content=_text(item.content, f"{where}.content")))
    elif item.type == "function_call":
        if item.call_id is None or item.name is None:
            raise ValidationError(f"`{where}`: a function_call needs `call_id` and `name`")
        call = ToolCallIn(id=item.call_id, function=FunctionCallIn(
            name=item.name, arguments=item.arguments or "{}"))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":  # the same turn: text, then calls
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif item.type == "function_call_output":
        if item.call_id is None:
            raise ValidationError(f"`{where}.call_id` is required: the call this output "
                                  "answers")
        messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                    content=_text(item.output, f"{where}.output")))
    else:
        raise ValidationError(f"`{where}.type` {item.type[:40]!r} is not supported by tpserve: "
                              "input items are messages, function_call and "
                              "function_call_output (it makes no reasoning items and runs no "
                              "built-in tools; item references need stored responses)")


def chat_tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ValidationError(f"`tools[{i}].type` {tool.type[:40]!r} is not supported: "
                                  "tpserve runs no built-in tools; describe a function tool "
                                  "and run it in your code")
        if tool.name is None:
            raise ValidationError(f"`tools[{i}].name` is required (function tools are flat "
                                  'here: {"type": "function", "name", "parameters"}, not '
                                  "nested under `function` as in chat completions)")
        out.append(Tool(function=FunctionDef(name=tool.name, description=tool.description,
                                             parameters=tool.parameters, strict=tool.strict)))
    return out


def chat_tool_choice(choice: Any) -> Any:
    """`tool_choice` in chat's spelling: {"type": "function", "name": f} is flat here."""
    if choice is None or isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise ValidationError('`tool_choice` must be "none", "auto", "required" or {"type": '
                          '"function", "name": ...}' + (f" (tool choice type {kind!r} is not "
                                                        "supported)" if kind else ""))
