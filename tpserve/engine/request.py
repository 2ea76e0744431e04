"""Typed values that cross the boundary between the HTTP layer and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["length", "eos_token", "stop_sequence"]


@dataclass(frozen=True)
class GuidedSpec:
    """What a guided (structured-output) request's text must match: a JSON schema (as JSON
    text; OpenAI's json_object is the schema {"type": "object"}) or a regular expression.
    Plain data: the engine compiles it (tpserve/engine/guided.py), keyed by this value."""

    kind: Literal["json_schema", "regex"]
    value: str
    # Where the request named it, for error messages (`parameters.grammar`, `response_format`).
    where: str = "grammar"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (TGI's `parameters`, already validated)."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI's: subtracted once from every token already generated (frequency_penalty
    # subtracts per occurrence).
    presence_penalty: float | None = None
    # OpenAI's logit_bias: (token id, value added to its logit) pairs, before penalties.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Number of most likely alternatives reported per generated token (0: none).
    top_n_tokens: int = 0
    # Which log-probabilities a generated token and its alternatives report: the model's own
    # (True: OpenAI's and vLLM's, the same whatever the temperature, top_p or penalties), or
    # those of the distribution the token was drawn from (False: TGI's).
    raw_logprobs: bool = False
    # Report log-probabilities of the prompt tokens (TGI's decoder_input_details).
    prompt_logprobs: bool = False
    # Whether generated_text (and the stream) keeps a stop string that ended generation:
    # True for TGI's routes, False for OpenAI's (tpserve/engine/output_processor.py).
    include_stop_str_in_output: bool = True
    # Structured output: every generated token is one the grammar allows (None: free text).
    guided: GuidedSpec | None = None
    # Special tokens whose text stays in the output (generated_text and the stream), where
    # decoding leaves special tokens out: a reasoning format's tags when they are special
    # tokens, as Mistral's [THINK] and [/THINK] (server/reasoning_format.py). Ids that
    # decoding keeps anyway change nothing.
    keep_special_ids: tuple[int, ...] = ()
    # The LoRA adapter (a --lora-modules name) whose weights join the base model's for this
    # request: OpenAI's `model`, TGI's `parameters.adapter_id`. None: the base model.
    adapter: str | None = None

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's token ids (its penalties)."""
        return bool(self.repetition_penalty and self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        """True when the next token is the arg-max (no randomness at all)."""
        if not self.do_sample and self.temperature is None and self.top_k is None \
                and self.top_p is None and self.typical_p is None:
            return True
        return self.temperature is not None and self.temperature == 0.0


# One per generated token. A plain dataclass: frozen ones take 3x as long to build, and
# orjson writes one with __slots__ 6x slower than one with a __dict__ (it writes these in
# every /generate answer with details).
@dataclass
class TokenInfo:
    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass
class GenerationEvent:
    """One event of a request's stream: a new token, and on the last event the final result."""

    token: TokenInfo
    top_tokens: list[TokenInfo] | None = None
    finished: bool = False
    # Set only when finished.
    generated_text: str | None = None
    finish_reason: FinishReason | None = None
    generated_tokens: int = 0
    seed: int | None = None
    prompt_tokens: int = 0
    prefill: list[TokenInfo] = field(default_factory=list)
    # With prompt_logprobs and top_n_tokens: each prompt token's likeliest alternatives
    # (none for the first).
    prefill_top: list[list[TokenInfo]] | None = None
