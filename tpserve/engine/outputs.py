"""What the engine core reports per generated token: ids and numbers, no text. The output
processor turns these into GenerationEvents (text, stop strings)."""

from __future__ import annotations

from collections.abc import Iterator
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
    # (token id, log p, top_n_tokens alternatives as (id, log p)) of each prompt token, the
    # first with None and no alternatives.
    prefill: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None


_REASONS: tuple[FinishReason | None, ...] = (None, "eos_token", "length", "stop_sequence")


_CODE = {r: i for i, r in enumerate(_REASONS)}


def pack_outputs(outputs: list[TokenOutput]) -> dict:
    """Outputs as a few numpy arrays (cheap to pickle across processes, unlike a dataclass
    per token); the rare extras (top-n, prompt log-probabilities) ride along as lists.
    Built from one list each (a numpy row assignment per token costs more than the rest)."""
    code = _CODE
    ints = np.array([(o.seq_id, o.token_id, o.generated_tokens,
                      o.prompt_tokens * 4 + code[o.finish_reason]) for o in outputs],
                    dtype=np.int64).reshape(-1, 4)
    logprobs = np.array([o.logprob for o in outputs], dtype=np.float64)
    top = {i: o.top for i, o in enumerate(outputs) if o.top}
    prefill = {i: o.prefill for i, o in enumerate(outputs) if o.prefill is not None}
    return {"ints": ints, "logprobs": logprobs, "top": top, "prefill": prefill}


def packed_rows(packed: dict) -> Iterator[tuple]:
    """(seq_id, token_id, logprob, top, generated_tokens, prompt_tokens, finish_reason,
    prefill) per packed output: TokenOutput's fields in order, without the object."""
    top, prefill, reasons = packed["top"], packed["prefill"], _REASONS
    rows = zip(packed["ints"].tolist(), packed["logprobs"].tolist(), strict=True)
    if not top and not prefill:  # the usual step: no extras to look up
        for (seq_id, token_id, generated, code), lp in rows:
            yield seq_id, token_id, lp, [], generated, code >> 2, reasons[code & 3], None
        return
    for i, ((seq_id, token_id, generated, code), lp) in enumerate(rows):
        yield (seq_id, token_id, lp, top.get(i, []), generated, code >> 2, reasons[code & 3],
               prefill.get(i))


def unpack_outputs(packed: dict) -> list[TokenOutput]:
    return [TokenOutput(*row) for row in packed_rows(packed)]
