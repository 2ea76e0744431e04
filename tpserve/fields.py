"""Constrained field types shared by the TGI (protocol.py) and OpenAI (server/openai.py)
request schemas: ranges live in the types, and every float must be finite.

A value outside a type's range is a 422 naming the field, before anything reaches the
engine. Where TGI and OpenAI accept different ranges for the same knob (temperature,
top_p), each schema keeps its own, since clients rely on them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, Strict

U64_MAX = 2**64 - 1  # TGI's seed is a u64
# Token counts fit the engine's int32 tensors; larger values could only fail later.
I32_MAX = 2**31 - 1


def _valid_unicode(v: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"), which no tokenizer can encode.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"must be valid Unicode text (a lone surrogate at character {exc.start})"
        ) from None
    return v


def _not_bool(v: Any) -> Any:
    # pydantic's lax mode reads JSON `true` as 1 and 1.0: a client that sent a boolean where a
    # number belongs made a mistake, which must not run as a one-token request.
    if isinstance(v, bool):
        raise ValueError(f"must be a number, not `{str(v).lower()}`")
    return v


# Numbers that refuse JSON booleans; every numeric field of both schemas is one of these.
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


def _finite(**range_: float) -> Any:
    return Field(allow_inf_nan=False, **range_)


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
# Every list and map of a request schema stops at its first bad item: pydantic would report
# each one (per member of a union), and FastAPI and the error handler walk those reports on
# the event loop (800,000 nulls as `prompt`: 46 s in which the server answered no one).
FailFast = Field(fail_fast=True)

# An empty stop string would match before the first token. A long one costs the engine time
# growing with the square of its length after every token (a 1 MB one against 30,000
# characters of output: 13 ms per token, in the step the whole batch waits for).
MAX_STOP_CHARS = 512
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS),
                     AfterValidator(_valid_unicode)]

# OpenAI's "boolean or null" flags (`stream`, `echo`): clients that write every field send
# null, which means the default, false.
NullableFlag = Annotated[bool, BeforeValidator(lambda v: False if v is None else v)]

TokenCount = Annotated[Int, Field(ge=1, le=I32_MAX)]
TopK = Annotated[Int, Field(ge=1, le=I32_MAX)]
TopN = Annotated[Int, Field(ge=0, le=I32_MAX)]
Seed = Annotated[Int, Field(ge=0, le=U64_MAX)]
# OpenAI's seed is an int64 (clients send -1); taken modulo 2^64 into the engine's u64 seed.
OpenAISeed = Annotated[Int, Field(ge=-(2**63), le=U64_MAX)]

FrequencyPenalty = Annotated[Float, _finite(ge=-2.0, le=2.0)]
# OpenAI's logit_bias: token ids (JSON object keys, so written as strings) to -100..100.
TokenIdKey = Annotated[int, Field(ge=0, le=I32_MAX)]  # written as a string: never a bool
# A prompt's token ids: strict (no bool, float or string), which pydantic checks without a
# Python call per id; a 4 MB body holds 1.9 million of them.
TokenId = Annotated[int, Strict(), Field(ge=0, le=I32_MAX)]
LogitBias = Annotated[Float, _finite(ge=-100.0, le=100.0)]
# The sampler walks each request's map on every step; a vocabulary-sized one (300,000
# entries fit in a 4 MB body) would slow every token of the whole batch.
MAX_LOGIT_BIAS_ENTRIES = 1024
LogitBiasMap = Annotated[dict[TokenIdKey, LogitBias],
                         Field(max_length=MAX_LOGIT_BIAS_ENTRIES, fail_fast=True)]
# Divides positive logits: any finite positive value; the sampler keeps rows finite.
RepetitionPenalty = Annotated[Float, _finite(gt=0.0)]
# TGI: strictly positive (0 is not greedy there); OpenAI: 0 (greedy) to 2.
TGITemperature = Annotated[Float, _finite(gt=0.0)]
OpenAITemperature = Annotated[Float, _finite(ge=0.0, le=2.0)]
# TGI: open interval (0, 1); OpenAI: [0, 1], 1 meaning "no top-p", 0 only the likeliest.
OpenUnitInterval = Annotated[Float, _finite(gt=0.0, lt=1.0)]
OpenAITopP = Annotated[Float, _finite(ge=0.0, le=1.0)]


def unsupported(feature: str, allowed: Any = None) -> AfterValidator:
    """A field tpserve parses but does not implement: any value but `allowed` (or a falsy
    one) is a 422 that names the feature."""

    def check(v: Any) -> Any:
        if v and v != allowed:
            raise ValueError(f"{feature} is not supported by tpserve")
        return v

    return AfterValidator(check)
