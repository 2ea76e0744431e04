"""Per-step state the attention layers need, scoped by a context manager."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tpserve.kernels.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: (k, v)
    backend: AttentionBackend
    # Encoder-decoder decoders: where cross attention finds the encoder output's K/V (the
    # same query layout as meta; seq_lens = encoder lengths, block_tables = cross blocks).
    cross_meta: AttentionMetadata | None = None
    # While a step is captured in pieces (worker/piecewise.py): takes each attention call's
    # inputs instead of the backend, ends the piece, and returns the buffer the output will
    # be in when the pieces replay.
    pieces: object | None = None


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CURRENT
    saved, _CURRENT = _CURRENT, ctx
    try:
        yield ctx
    finally:
        _CURRENT = saved


def current() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention called outside tpserve.layers.context.forward_context")
    return _CURRENT
