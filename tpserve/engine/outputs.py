"""What the engine core reports per generated token: ids and numbers, no text. The output
processor turns these into GenerationEvents (text, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


_REASONS: tuple[FinishReason | None, ...] = (None, "eos_token", "length", "stop_sequence")


def pack_outputs(outputs: list[TokenOutput]) -> dict:
    """Outputs as a few numpy arrays (cheap to pickle across processes, unlike a dataclass
    per token); the rare extras (top-n, prompt log-probabilities) ride along as lists."""
    n = len(outputs)
    ints = np.empty((n, 4), dtype=np.int64)
    logprobs = np.empty(n, dtype=np.float64)
    top, prefill = {}, {}
    for i, o in enumerate(outputs):
        ints[i] = (o.seq_id, o.token_id, o.generated_tokens,
                   o.prompt_tokens * 4 + _REASONS.index(o.finish_reason))
        logprobs[i] = o.logprob
        if o.top:
            top[i] = o.top
        if o.prefill is not None:
            prefill[i] = o.prefill
    return {"ints": ints, "logprobs": logprobs, "top": top, "prefill": prefill}


def unpack_outputs(packed: dict) -> list[TokenOutput]:
    top, prefill = packed["top"], packed["prefill"]
    out = []
    for i, ((seq_id, token_id, generated, code), lp) in enumerate(
            zip(packed["ints"].tolist(), packed["logprobs"].tolist(), strict=True)):
        out.append(TokenOutput(seq_id, token_id, lp, top.get(i, []), generated, code // 4,
                               _REASONS[code % 4], prefill.get(i)))
    return out
