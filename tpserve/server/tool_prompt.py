"""Chat templates and tools: a conversation with tools, assistant tool calls and tool results
rendered by the model's own template where it knows tools, and by tpserve's stand-in where
it does not.

The template gets `tools` (OpenAI's tool objects) and the messages as transformers documents
them: an assistant turn's `tool_calls` with `arguments` as an object (Llama's and most
templates write them with `tojson`), a `tool` turn with its `tool_call_id`.

A template that renders the same prompt with and without `tools` ignores them (the output
is compared), and one that fails on the conversation cannot take it. Then tpserve describes
the tools in a system message (merged into the first one, or, when the template refuses a
system turn, put before the first user message) and writes the history as text in the
format it asks for: calls as `<tool_call>{"name", "arguments"}</tool_call>` in the
assistant's content, and each run of tool results as one user turn of
`<tool_response>...</tool_response>` blocks (so user/assistant alternation holds).
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable
from typing import Any

from tpserve.errors import ValidationError
from tpserve.server.tools import ToolPlan

Render = Callable[..., str]  # EngineBackend.apply_chat_template(messages, tools=...)

PREAMBLE = "You can call the functions described by these JSON schemas:"
FORMAT = ('To call functions, answer with one block per call and nothing else:\n'
          '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
          '</tool_call>\nOtherwise answer as usual.')


def tools_text(plan: ToolPlan, preamble: str | None) -> str:
    """The stand-in system text: the tools, and for `auto` how to call them (the forced
    choices' output is constrained, so the format is not the model's to choose)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.template_tools())
    text = f"{preamble or PREAMBLE}\n<tools>\n{schemas}\n</tools>"
    return f"{text}\n\n{FORMAT}" if plan.mode == "auto" else text


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    body = {"name": fn.get("name"), "arguments": fn.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def as_plain_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its tool turns written as text, for a template without tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append({"role": m["role"],
                        "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _in_first_user(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    for m in out:
        if m["role"] == "user":
            m["content"] = f"{text}\n\n{m.get('content') or ''}"
            return out
    return [{"role": "user", "content": text}, *out]


def _try(render: Render, messages: list[dict], **kw: Any) -> str | ValidationError:
    try:
        return render(messages, **kw)
    except ValidationError as exc:  # the template refused (or failed on) this input
        return exc


_ALNUM = string.ascii_letters + string.digits


def _nine(call_id: str) -> str:
    """A call id as 9 letters and digits, the same for the same id (Mistral's templates
    refuse any other shape; OpenAI's are `call_` and 24 characters)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(n // 62**i) % 62] for i in range(9))


def short_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with its call ids (assistant `tool_calls`, tool turns'
    `tool_call_id`) mapped to 9 characters, consistently; None when no id changes."""
    out, changed = [], False
    for m in messages:
        m = dict(m)
        if m.get("tool_call_id"):
            m["tool_call_id"] = _nine(str(m["tool_call_id"]))
            changed |= m["tool_call_id"] != messages[len(out)]["tool_call_id"]
        if m.get("tool_calls"):
            calls = [{**c, "id": _nine(str(c["id"]))} if c.get("id") else c
                     for c in m["tool_calls"]]
            changed |= calls != m["tool_calls"]
            m["tool_calls"] = calls
        out.append(m)
    return out if changed else None


def _try_ids(render: Render, messages: list[dict], **kw: Any) -> str | ValidationError:
    """Rendered as sent, else, where the template refused and the call ids can change,
    with 9-character ids."""
    first = _try(render, messages, **kw)
    if isinstance(first, str):
        return first
    shorter = short_ids(messages)
    if shorter is None:
        return first
    second = _try(render, shorter, **kw)
    return second if isinstance(second, str) else first


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def render_chat(render: Render, messages: list[dict[str, Any]], plan: ToolPlan | None,
                preamble: str | None = None) -> str:
    """The prompt of a chat request; ValidationError when no form of it renders."""
    if plan is None:
        first = _try_ids(render, messages)
        if isinstance(first, str) or not _has_tool_turns(messages):
            return _raise_or(first)
        return _raise_or(_try(render, as_plain_turns(messages)))
    native = _try_ids(render, messages, tools=plan.template_tools())
    if isinstance(native, str) and native != _try(render, messages):
        return native  # the template renders the tools itself
    plain = as_plain_turns(messages)
    if plan.mode == "none":  # no calls wanted: nothing to teach the model
        return _raise_or(_try(render, plain))
    text = tools_text(plan, preamble)
    prompt = _try(render, _with_system(plain, text))
    if isinstance(prompt, ValidationError):  # e.g. "system role not supported"
        prompt = _try(render, _in_first_user(plain, text))
    return _raise_or(prompt)


def _raise_or(result: str | ValidationError) -> str:
    if isinstance(result, ValidationError):
        raise result
    return result
