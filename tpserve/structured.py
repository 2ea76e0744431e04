"""The request fields of structured output: TGI's `parameters.grammar` and OpenAI's
`response_format`, read into the engine's GuidedSpec. Shapes are checked here (a 422 naming
the field); whether a schema or regex compiles is the engine's check (engine/guided.py).
Shared by the HTTP server and tpserve.Client: no engine or library import."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, model_validator

from tpserve.engine.request import GuidedSpec

# OpenAI's json_object: any JSON object.
ANY_OBJECT = '{"type":"object"}'


def schema_text(value: Any, where: str) -> str:
    """A JSON schema sent as an object or as JSON text, as compact JSON text (the engine's
    cache key: the same schema sent either way compiles once). Keys keep their order: the
    order of a schema's properties is the order the generated object lists them in."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"`{where}` is not valid JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"`{where}` must be a JSON schema: an object (got "
                         f"{type(value).__name__})")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _schema_config(value: Any, where: str) -> str:
    """TGI 3's `json_schema` grammar value, {"name": ..., "schema": <JSON schema>} (object or
    JSON text; the name is a label only), as compact schema text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"`{where}` is not valid JSON: {exc}") from None
    if not isinstance(value, dict) or "schema" not in value:
        raise ValueError(f"`{where}` of a json_schema grammar must be an object "
                         '{"name": ..., "schema": <JSON schema>}; for a bare schema use '
                         '{"type": "json", "value": <schema>}')
    return schema_text(value["schema"], f"{where}.schema")


class Grammar(BaseModel):
    """TGI's `grammar`: {"type": "json", "value": <JSON schema, object or text>},
    {"type": "json_schema", "value": {"name": ..., "schema": <JSON schema>}} (TGI 3) or
    {"type": "regex", "value": "<regular expression>"}."""

    type: Literal["json", "json_schema", "regex"]
    value: str | dict[str, Any]

    @model_validator(mode="after")
    def _value_fits_type(self) -> Grammar:
        self.spec()  # raises ValueError naming the field
        return self

    def spec(self, where: str = "grammar") -> GuidedSpec:
        field = where if where.endswith(".value") else f"{where}.value"
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise ValueError(f"`{field}` of a regex grammar must be a string")
            return GuidedSpec("regex", self.value, where)
        if self.type == "json_schema":
            return GuidedSpec("json_schema", _schema_config(self.value, field), where)
        return GuidedSpec("json_schema", schema_text(self.value, field), where)


def response_format_spec(fmt: dict[str, Any] | None) -> GuidedSpec | None:
    """OpenAI's `response_format` (text, json_object, json_schema; also TGI's own json and
    regex forms, which text_generation.Client.chat sends) as a GuidedSpec; None for text.
    Raises ValueError naming the field."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_schema", ANY_OBJECT, "response_format")
    if kind == "json_schema" and "json_schema" not in fmt and "value" in fmt:
        # TGI 3's chat route takes its grammar type here: {"type": "json_schema", "value": ...}
        return Grammar.model_construct(type=kind, value=fmt["value"]).spec(
            "response_format.value")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise ValueError("`response_format.json_schema` must be an object with `name` "
                             "and `schema`")
        if "schema" not in inner:  # optional in OpenAI's API: any JSON object then
            return GuidedSpec("json_schema", ANY_OBJECT, "response_format")
        return GuidedSpec("json_schema",
                          schema_text(inner["schema"], "response_format.json_schema.schema"),
                          "response_format.json_schema.schema")
    if kind in ("json", "regex"):  # TGI's forms
        if isinstance(fmt.get("value"), str | dict):
            return Grammar.model_construct(type=kind, value=fmt["value"]).spec(
                "response_format.value")
        what = "a regular expression (a string)" if kind == "regex" else \
            "a JSON schema (an object, or its JSON text)"
        raise ValueError(f"`response_format.value` of a {kind} response_format must be "
                         f"{what}")
    raise ValueError(f"`response_format.type` must be text, json_object or json_schema "
                     f"(or TGI's json or regex, with a `value`) (got {kind!r})")
