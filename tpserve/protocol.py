"""TGI wire format, shared by the HTTP server and tpserve.Client.

Field names and defaults follow text-generation-inference (and the `text_generation`
client's types), so TGI clients and tpserve clients can talk to either server.
Rules that need the served model's limits live in `check_limits`, because pydantic
validation alone cannot see the ModelInfo.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import SamplingParams
from tpserve.errors import ValidationError
from tpserve.fields import (
    FailFast,
    FrequencyPenalty,
    Int,
    NonEmptyText,
    NullableFlag,
    OpenUnitInterval,
    RepetitionPenalty,
    Seed,
    StopText,
    Text,
    TGITemperature,
    TokenCount,
    TopK,
    TopN,
    unsupported,
)
from tpserve.lora_config import select_adapter
from tpserve.structured import Grammar

FinishReason = Literal["length", "eos_token", "stop_sequence"]

DEFAULT_MAX_NEW_TOKENS = 20


class GenerateParameters(BaseModel):
    """TGI's `parameters` object. Unknown keys are ignored, as TGI's serde does."""

    model_config = ConfigDict(allow_inf_nan=False)

    # Candidates generated for the one answer (the likeliest per token wins): a
    # --max-best-of limit on the server, `_best_of_rules` below.
    best_of: Annotated[Int, Field(ge=1)] | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: FrequencyPenalty | None = None
    # Structured output: the generated text matches a JSON schema or a regex.
    grammar: Grammar | None = None
    max_new_tokens: TokenCount | None = DEFAULT_MAX_NEW_TOKENS
    repetition_penalty: RepetitionPenalty | None = None
    # TGI's Option<bool>: null means the default, false.
    return_full_text: NullableFlag = False
    seed: Seed | None = None
    stop: Annotated[list[StopText], FailFast] = Field(default_factory=list)
    temperature: TGITemperature | None = None
    top_k: TopK | None = None
    top_n_tokens: TopN | None = None
    top_p: OpenUnitInterval | None = None
    truncate: TokenCount | None = None
    typical_p: OpenUnitInterval | None = None
    watermark: Annotated[bool, unsupported("`watermark`")] = False
    # A LoRA adapter served here (--lora-modules name); None or the model's id: none.
    adapter_id: Text | None = None

    @property
    def sampling(self) -> bool:
        """TGI's rule: a sampling knob that changes the distribution turns sampling on.
        Temperature 1.0 changes nothing, and TGI decodes greedily with it (its router reads
        a missing temperature as 1.0); the other knobs' neutral values are refused."""
        knobs = (self.top_k, self.top_p, self.typical_p)
        return (self.do_sample or self.temperature not in (None, 1.0)
                or any(k is not None for k in knobs))

    @model_validator(mode="after")
    def _best_of_rules(self) -> GenerateParameters:
        # TGI's rules (router/src/validation.rs): unsampled candidates would all be the same
        # sequence, and so would candidates sharing one seed. Its sampling test is wider than
        # `sampling` above: any knob given counts, temperature 1.0 included.
        if (self.best_of or 1) <= 1:
            return self
        knobs = (self.temperature, self.top_k, self.top_p, self.typical_p)
        if not self.do_sample and all(k is None for k in knobs):
            raise ValueError("`best_of` > 1 needs sampling: set `do_sample` to true (or one "
                             "of `temperature`, `top_k`, `top_p`, `typical_p`)")
        if self.seed is not None:
            raise ValueError("`seed` must not be set when `best_of` > 1: each candidate gets "
                             "a seed of its own, reported in its details")
        return self


class GenerateRequest(BaseModel):
    """Body of POST /generate, /generate_stream and / (TGI's compat route)."""

    inputs: NonEmptyText
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, v):
        # Clients that build the body from optional fields send "parameters": null.
        return {} if v is None else v


def check_limits(params: GenerateParameters, info: ModelInfo) -> None:
    """The rules that depend on the served model; raises tpserve ValidationError."""
    if len(params.stop) > info.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {info.max_stop_sequences} stop sequences "
            f"(got {len(params.stop)})"
        )
    if params.top_n_tokens is not None and params.top_n_tokens > info.max_top_n_tokens:
        raise ValidationError(
            f"`top_n_tokens` must be <= {info.max_top_n_tokens} (got {params.top_n_tokens})"
        )
    if params.truncate is not None and params.truncate > info.max_input_tokens:
        raise ValidationError(
            f"`truncate` must be <= max_input_tokens ({info.max_input_tokens}) "
            f"(got {params.truncate})"
        )
    try:
        select_adapter(params.adapter_id, info.model_id, info.adapters)
    except ValueError as exc:
        raise ValidationError(f"`adapter_id`: {exc}") from None
    max_new = params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if max_new >= info.max_total_tokens:
        raise ValidationError(
            f"`max_new_tokens` must be < max_total_tokens ({info.max_total_tokens}), "
            f"leaving room for the prompt (got {max_new})"
        )


def check_best_of(params: GenerateParameters, max_best_of: int) -> int:
    """The request's number of candidates, at most the server's --max-best-of."""
    return check_max_best_of(params.best_of or 1, max_best_of)


def check_max_best_of(n: int, max_best_of: int) -> int:
    """`best_of` = n candidates of one prompt (TGI's /generate, OpenAI's /v1/completions), at
    most the server's --max-best-of."""
    if n > max_best_of:
        raise ValidationError(f"`best_of` must be <= {max_best_of} (got {n}): the most "
                              "candidates this server generates per prompt (--max-best-of)")
    return n


def check_streamable(params: GenerateParameters) -> None:
    """Extra rules for the streaming routes (TGI has the same restrictions)."""
    if (params.best_of or 1) > 1:
        # A stream shows one sequence as it is made; the best is known only at the end.
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if params.decoder_input_details:
        raise ValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens"
        )


def to_sampling_params(params: GenerateParameters, info: ModelInfo | None = None
                       ) -> SamplingParams:
    """Convert validated wire parameters (check_limits passed) into the engine's
    SamplingParams; info: the served model, which names the adapters."""
    adapter = None if info is None else \
        select_adapter(params.adapter_id, info.model_id, info.adapters)
    return SamplingParams(
        max_new_tokens=params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        do_sample=params.sampling,
        temperature=params.temperature if params.sampling else None,
        top_k=params.top_k,
        top_p=params.top_p,
        typical_p=params.typical_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        stop=tuple(params.stop),
        top_n_tokens=params.top_n_tokens or 0,
        prompt_logprobs=params.decoder_input_details,
        guided=params.grammar.spec("parameters.grammar") if params.grammar else None,
        adapter=adapter,
    )


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part: Any) -> bool:
    """True for the parts of a pydantic error location that a client wrote (field names,
    list indices), False for "body" and the tags pydantic adds inside unions and validators
    (`function-after[...]`, `constrained-str`, `list[str]`)."""
    if isinstance(part, int):
        return True
    return (part != "body" and part not in _UNION_TAGS
            and part.replace("_", "a").isalnum() and part.isascii())


# pydantic writes the bound of an int field with a validator of its own as a float: the seed's
# 18446744073709551615 read "less than or equal to 18446744073709552000". The exact bound is
# in the error's ctx.
_BOUNDS = {"less_than_equal": ("le", "less than or equal to"),
           "greater_than_equal": ("ge", "greater than or equal to"),
           "less_than": ("lt", "less than"), "greater_than": ("gt", "greater than")}


def _message(kind: str, ctx: Mapping[str, Any], msg: Any) -> Any:
    key, words = _BOUNDS.get(kind, ("", ""))
    bound = ctx.get(key)
    if isinstance(bound, int) and not isinstance(bound, bool):
        return f"Input should be {words} {bound}"
    return msg


def describe_errors(errors: Iterable[Mapping[str, Any]]) -> str:
    """One human sentence from pydantic/FastAPI error dicts, naming field and rule."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if _is_field(p)]
        kind = err.get("type", "")
        ctx = err.get("ctx") or {}
        msg = _message(kind, ctx, err.get("msg"))
        if kind == "json_invalid":
            parts.append(f"invalid JSON body: {ctx.get('error', err.get('msg'))}")
        elif kind == "value_error" and str(ctx.get("error", "")).startswith("`"):
            # Our validators already phrase the whole message, field name included.
            parts.append(str(ctx["error"]))
        elif kind == "value_error" and "error" in ctx and loc:
            parts.append(f"`{'.'.join(loc)}` {ctx['error']}")
        elif loc:
            parts.append(f"`{'.'.join(loc)}`: {msg}")
        else:
            parts.append(f"request body: {msg}")
    # A union (OpenAI's prompt: a string or three kinds of list) fails once per member.
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


class _WireModel(BaseModel):
    """Base for responses."""


class _OmitEmpty(_WireModel):
    """A response that drops the keys TGI leaves out when they are empty. Only the models
    that need it carry this serializer: it runs in Python for every instance, and a
    per-token model with it costs more than the whole rest of a response."""

    _omit_when_empty: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self._omit_when_empty:
            if data.get(key) in (None, []):
                data.pop(key, None)
        return data


class Token(_WireModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class InputToken(_WireModel):
    id: int
    text: str
    # None for the first prompt token: nothing predicts it.
    logprob: float | None = None


class _Generation(_OmitEmpty):
    """How one sequence was generated: what Details and each best_of candidate report."""

    _omit_when_empty = ("top_tokens",)

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None


class BestOfSequence(_Generation):
    """A `best_of` candidate that lost: its text and the details of its generation."""

    generated_text: str


class Details(_Generation):
    _omit_when_empty = ("top_tokens", "best_of_sequences")

    # The other candidates of a `best_of` > 1 request, in the order they were started.
    best_of_sequences: list[BestOfSequence] | None = None


class Response(_OmitEmpty):
    """Body of POST /generate; `details` is present only when requested."""

    _omit_when_empty = ("details",)

    generated_text: str
    details: Details | None = None


class StreamDetails(_WireModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    # TGI's: the prompt's tokens (after `truncate`). Optional so that tpserve.Client reads
    # servers (TGI < 2) that do not send it.
    input_length: int | None = None


class StreamResponse(_WireModel):
    """One SSE event of /generate_stream; the last one carries generated_text (and details)."""

    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(_WireModel):
    error: str
    error_type: str
