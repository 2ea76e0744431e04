"""What the engine core reports per generated token: ids and numbers, no text. The output
processor turns these into GenerationEvents (text, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.engine.request import FinishReason


@dataclass
class TokenOutput:
    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top_n_tokens alternatives, (id, log p)
    generated_tokens: int  # tokens generated so far, this one included
    prompt_tokens: int
    # Set by the core when this token ends the sequence (EOS or length: they free KV blocks).
    finish_reason: FinishReason | None = None
    # On the first output of a request that asked for prompt log-probabilities:
    # (token id, log p) of each prompt token, the first with None.
    prefill: list[tuple[int, float | None]] | None = None
