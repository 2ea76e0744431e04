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
    # Mostly well-formed (so that many bodies pass validation and reach the backend, and
    # the rest fail deep inside), sometimes anything at all.
    return st.one_of(*[shaped] * 7, hostile_json)


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
        optional = sorted(k for k in fields if k not in required)

        @st.composite
        def objects(draw: st.DrawFn) -> dict:
            # A few optional fields at a time: a body with all of them is almost never valid.
            keys = [k for k in fields if k in required]
            keys += draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)
                         if optional else st.just([]))
            return {k: draw(fields[k]) for k in keys}

        return objects()
    if kind == "array":
        item = from_schema(schema.get("items", {}), components, depth + 1)
        return st.lists(item, max_size=8)
    if kind == "string":
        words = st.lists(st.sampled_from(["a", "b", "</s>", "é", "x y"]), min_size=1,
                         max_size=8).map(" ".join)
        return st.one_of(words, words, st.text(max_size=60), st.sampled_from(EDGE_STRINGS))
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -5))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 300))
        near = [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1]
        in_range = st.integers(min_value=lo, max_value=max(lo, min(hi, lo + 40)))
        return st.one_of(in_range, in_range, st.sampled_from(near), st.sampled_from(EDGE_NUMBERS))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -3.0))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 3.0))
        in_range = st.floats(min_value=lo, max_value=max(lo, min(hi, lo + 3.0)),
                             exclude_min="exclusiveMinimum" in schema,
                             exclude_max="exclusiveMaximum" in schema)
        return st.one_of(in_range, in_range, st.sampled_from(EDGE_NUMBERS))
    if kind == "boolean":
        return st.booleans()
    return hostile_json
