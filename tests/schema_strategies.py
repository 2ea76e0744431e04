"""Hypothesis strategies for request bodies, driven by the OpenAPI schema the app serves.

`from_schema` draws values that mostly follow the schema (so they reach deep validation and
the backend) and `hostile_json` draws what a broken or hostile client sends: wrong types,
nulls, NaN and Infinity, huge and negative numbers, lone surrogates, long strings, nesting.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

EDGE_NUMBERS = [0, -1, 1, 2**31, 2**63, 2**64, -(2**64), 10**30, 5e-324, 1e-38, 1e-40, 1e308,
                -1e308, math.nan, math.inf, -math.inf, 0.5, 1.0, 2.0, 2.0000001, -2.0]
EDGE_STRINGS = ["", " ", "\x00", "\ud800", "a\udfffb", "</s>", "\u202e", "é" * 50,
                "{\"inputs\": 1}", "../../etc/passwd", "a" * 5000]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_NUMBERS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_STRINGS), st.text(max_size=40),
)

hostile_json = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=30,
)


def _resolve(schema: dict, components: dict) -> dict:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values shaped by `schema`, with a share of hostile values at every level."""
    schema = _resolve(schema, components)
    if depth > 6:
        return scalars
    shaped = _shaped(schema, components, depth)
    # Mostly well-formed (to get past the outer layers), sometimes anything at all.
    return st.one_of(shaped, shaped, shaped, hostile_json)


def _shaped(schema: dict, components: dict, depth: int) -> st.SearchStrategy[Any]:
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of([from_schema(s, components, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: from_schema(v, components, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        item = from_schema(schema.get("items", {}), components, depth + 1)
        return st.lists(item, max_size=8)
    if kind == "string":
        return st.one_of(st.text(max_size=60), st.sampled_from(EDGE_STRINGS))
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        near = [v for v in (lo, hi) if v is not None]
        near += [v + d for v in near for d in (-1, 1)]
        return st.one_of(st.integers(min_value=-5, max_value=300),
                         st.sampled_from(near or [0]), st.sampled_from(EDGE_NUMBERS))
    if kind == "number":
        return st.one_of(st.floats(min_value=-3, max_value=3), st.sampled_from(EDGE_NUMBERS))
    if kind == "boolean":
        return st.booleans()
    return hostile_json
