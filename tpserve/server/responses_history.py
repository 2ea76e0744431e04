"""A stored conversation's items, as GET /v1/responses/{id}/input_items lists them and as
`previous_response_id` continues them.

Input items are kept in the shape the `openai` client's ResponseItem types read (each with
an id, a status, and content as parts): a user, system or developer message as an input
message with `input_text` parts, an assistant one as an output message with `output_text`
parts, a call and its output as function_call and function_call_output items. The shape
changes nothing about the prompt: parts are joined as the request's own content was
(server/responses_items.py), so a conversation continued from the store renders as the
same conversation sent whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError
from starlette.datastructures import QueryParams

from tpserve.errors import ValidationError
from tpserve.fields import Int, Text, unsupported
from tpserve.protocol import describe_errors
from tpserve.server.responses_items import Content, InputItem
from tpserve.server.responses_output import new_id

Item = dict[str, Any]
Q = TypeVar("Q", bound=BaseModel)


def _parts(content: Content | None, kind: str) -> list[dict[str, Any]]:
    """Text parts of one kind (input_text or output_text); a refusal stays one in an
    assistant message."""
    if content is None:
        return []
    if isinstance(content, str):
        return [_part(kind, content)]
    out = []
    for part in content:
        if part.type == "refusal" and kind == "output_text":
            out.append({"type": "refusal", "refusal": part.refusal or ""})
        else:
            out.append(_part(kind, part.text if part.type != "refusal" else part.refusal))
    return out


def _part(kind: str, text: str | None) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text or "", "annotations": []}
    return {"type": "input_text", "text": text or ""}


def _joined(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text or "" if p.type != "refusal" else p.refusal or "" for p in content)


def stored_item(item: InputItem) -> Item:
    """An input item (already accepted by the chat translation) in the stored shape."""
    base = {"id": item.id or new_id(_ID_PREFIX.get(item.type, "item")), "type": item.type,
            "status": "completed"}
    if item.type == "message":
        kind = "output_text" if item.role == "assistant" else "input_text"
        return {**base, "role": item.role, "content": _parts(item.content, kind)}
    if item.type == "function_call":
        return {**base, "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments or "{}"}
    if item.type == "function_call_output":
        return {**base, "call_id": item.call_id, "output": _joined(item.output)}
    # reasoning (an earlier answer's, left out of the prompt): its text, no summary
    return {**base, "summary": [],
            "content": [{"type": "reasoning_text", "text": _joined(item.content)}]}


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def as_input(items: Sequence[Item]) -> list[InputItem]:
    """Stored items as a request's input items again."""
    return [InputItem.model_validate(item) for item in items]


def query_dict(params: QueryParams) -> dict[str, Any]:
    """A query string as a model reads it: `include` repeated or as `include[]` (the
    openai client's spelling), one value for each other name."""
    out: dict[str, Any] = {}
    for key in params.keys():
        name = key.removesuffix("[]")
        out[name] = params.getlist(key) if name == "include" else params[key]
    return out


def parse_query(model: type[Q], params: QueryParams) -> Q:
    """The query checked by `model`; a 422 naming the parameter, as for bodies."""
    try:
        return model.model_validate(query_dict(params))
    except PydanticValidationError as exc:
        raise ValidationError(describe_errors(exc.errors())) from None


class RetrieveQuery(BaseModel):
    """GET /v1/responses/{id}'s query. The stored response is answered whole: replaying
    its stream events (`stream`, `starting_after`) is not served."""

    model_config = ConfigDict(extra="forbid")

    include: list[Text] | None = None  # outputs of items tpserve never makes
    include_obfuscation: bool | None = None  # for streams, which are not replayed
    stream: Annotated[bool | None, unsupported(
        "`stream` (replaying a stored response's events; GET it whole)", allowed=False)] = None
    starting_after: Annotated[Int | None, unsupported(
        "`starting_after` (replaying a stored response's events; GET it whole)")] = None


class InputItemsQuery(BaseModel):
    """GET /v1/responses/{id}/input_items's query: OpenAI's cursor pagination."""

    model_config = ConfigDict(extra="forbid")

    limit: Annotated[Int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: Text | None = None
    # Outputs of items tpserve never makes (search results, images...): nothing to add.
    include: list[Text] | None = None


def input_items_page(items: Sequence[Item], query: InputItemsQuery) -> dict[str, Any]:
    """One page of `items` (oldest first), as OpenAI's list objects: newest first unless
    order is asc, starting after the item `after` names."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start = 0
    if query.after is not None:
        ids = [item["id"] for item in ordered]
        if query.after not in ids:
            raise ValidationError(f"`after` ({query.after[:64]!r}) is not the id of an input "
                                  "item of this response")
        start = ids.index(query.after) + 1
    page = ordered[start:start + query.limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + query.limit < len(ordered)}
