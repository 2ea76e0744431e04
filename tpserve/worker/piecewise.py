"""Steps no decode graph holds (mixed prefill + decode steps, mostly) replayed as CUDA graphs
in pieces: the work between two attention calls is one graph per token-count bucket, and
attention runs eagerly between the pieces.

Why pieces: an eager step launches a few hundred kernels from Python (~10 ms of host work for
a Llama-3-8B step), far more than the device needs for a step of a few dozen decode rows and
one short prompt, so every admission stalled all running streams. Attention cannot be in the
graph: what it does depends on each sequence's length and chunk, not only on the step's
token count. Everything else (embeddings, norms, projections, activations, all-reduces) has
the shape of the token count alone, so it is captured at a few bucket sizes in warmup and
a step of n tokens replays the smallest bucket >= n; rows past n compute on stale inputs
and are never read. Steps above the largest bucket run eagerly: they are compute-bound, and
their launches hide behind the device.

During capture the attention layers hand their inputs to a Recorder (ForwardContext.pieces):
it copies q, k, v into a staging buffer shared by every layer and bucket (inside the piece
being captured, so each replay refreshes it), ends that piece's graph and starts the next,
and returns a shared output buffer the next piece reads. The copies keep the memory held
between pieces to one buffer, instead of every layer's projections for every bucket.

With LoRA adapters loaded, the pieces hold every adapter's delta in its masked form
(layers/lora.py): each token row's adapter slot is a static input like the token ids, and
the first piece turns it into the row mask the later pieces read (a static buffer too).
Every bucket is captured a second time without LoRA, for steps in which no row names an
adapter (the masked form would compute every loaded adapter's delta for every row); the
two sets share the staging and output buffers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from tpserve.cluster.device import piece_capture_api, synchronize
from tpserve.kernels.base import AttentionMetadata
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.layers.lora import StaticLoraRows, static_scope
from tpserve.worker.metadata import make_metadata

ENV = "TPSERVE_PIECEWISE_GRAPHS"  # 0: mixed steps run eagerly (A/B runs)
# Token counts captured. Past 512 tokens a Llama-3-8B step is compute-bound on an H200
# (docs/benchmarks.md, "Mixed steps in pieces"): its launches hide behind the device.
TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)
# A mixture of experts runs every expert on every token inside a graph (layers/moe.py: its
# routing has data-dependent shapes). Up to 64 tokens a step reads every expert's weights
# anyway; beyond, the dense path's extra work would outweigh the launches it saves.
MOE_MAX_TOKENS = 64


def token_buckets(max_tokens: int, model=None) -> tuple[int, ...]:
    """The buckets up to the engine's per-step token budget (at least the smallest), and
    up to MOE_MAX_TOKENS for a model with a mixture of experts."""
    from tpserve.layers.moe import SparseMoE

    if model is not None and any(isinstance(m, SparseMoE) for m in model.modules()):
        max_tokens = min(max_tokens, MOE_MAX_TOKENS)
    return tuple(b for b in TOKEN_BUCKETS if b <= max_tokens) or TOKEN_BUCKETS[:1]


def wanted() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass
class _Call:
    """One attention call of a captured bucket: its layer, and the staged inputs the
    eager attention reads after the piece before it replays."""
    layer: torch.nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    out: torch.Tensor


@dataclass
class _Bucket:
    graphs: list = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class Recorder:
    """Set on the ForwardContext while a bucket is captured (see the module docstring)."""

    def __init__(self, owner: PiecewiseGraphs, bucket: _Bucket, tokens: int) -> None:
        self.owner, self.bucket, self.tokens = owner, bucket, tokens

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> the buffer that will hold attention's
        output [T, heads * d] when the next piece replays."""
        staged = self.owner.stage((q, k, v))
        for src, dst in zip((q, k, v), staged, strict=True):
            dst.copy_(src)
        out = self.owner.output(self.tokens, q.shape[1] * q.shape[2])
        self.bucket.calls.append(_Call(layer, *staged, rope, out))
        self.owner.next_piece(self.bucket)
        return out


class PiecewiseGraphs:
    """The captured buckets of one worker: capture() in warmup, run() for a step of up to
    the largest bucket's tokens (fits())."""

    def __init__(self, model, kv_caches, backend, device: torch.device,
                 buckets: tuple[int, ...], block_size: int, scratch_block: int) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.device, self.block_size, self.scratch = device, block_size, scratch_block
        self.buckets = tuple(sorted(set(buckets)))
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.lora = StaticLoraRows.of(model, n, device)  # None without adapters
        self.captured: dict[int, _Bucket] = {}
        # With adapters: every bucket again without LoRA, for steps no row of which names
        # an adapter (as DecodeGraphs.base_graphs).
        self.base_captured: dict[int, _Bucket] = {}
        self._staging: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._pool = None
        self._graph_cls = None
        self.seconds = 0.0  # capture time

    # --- capture ------------------------------------------------------------------------
    def stage(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Contiguous views of the shared staging buffer shaped like `tensors`, back to
        back. Sized before capture (_size_buffers), so capturing never allocates it."""
        views, at = [], 0
        for t in tensors:
            n = t.numel()
            if at + n > self._staging.numel() or t.dtype != self._staging.dtype:
                raise RuntimeError(f"piecewise graphs: an attention input {tuple(t.shape)} "
                                   f"{t.dtype} does not fit the staging buffer")
            views.append(self._staging[at:at + n].view(t.shape))
            at += n
        return views

    def output(self, tokens: int, width: int) -> torch.Tensor:
        return self._out[: tokens * width].view(tokens, width)

    def next_piece(self, bucket: _Bucket) -> None:
        bucket.graphs[-1].capture_end()
        self._pool = bucket.graphs[-1].pool()
        self._begin(bucket)

    def _begin(self, bucket: _Bucket) -> None:
        graph = self._graph_cls()
        graph.capture_begin(pool=self._pool)
        bucket.graphs.append(graph)

    def _warm_meta(self, tokens: int) -> AttentionMetadata:
        """`tokens` one-token sequences writing the scratch block (as a decode graph's
        padded rows do): what the warm eager run attends with."""
        dev = self.device
        starts = torch.arange(tokens + 1, dtype=torch.int32, device=dev)
        lens = torch.ones(tokens, dtype=torch.int32, device=dev)
        tables = torch.full((tokens, 1), self.scratch, dtype=torch.int32, device=dev)
        slots = torch.full((tokens,), self.scratch * self.block_size, dtype=torch.long,
                           device=dev)
        return make_metadata(starts, lens, tables, slots, (1,) * tokens, (1,) * tokens)

    def _size_buffers(self, tokens: int, dtype: torch.dtype) -> None:
        """Staging and output buffers for the largest bucket: the widest attention call's
        q, k and v, and its output. Found by one eager forward that records the shapes."""
        widths: list[tuple[int, int]] = []

        class _Probe:
            def attend(self, layer, q, k, v, rope):
                widths.append((q.numel() + k.numel() + v.numel(), q.numel()))
                return layer.attend(q, k, v, rope=rope)

        meta = self._warm_meta(tokens)
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend,
                                            pieces=_Probe())), static_scope(self.lora, tokens):
            self.model(self.ids[:tokens], self.positions[:tokens])
        staged = max(w[0] for w in widths)
        out = max(w[1] for w in widths)
        self._staging = torch.zeros(staged, dtype=dtype, device=self.device)
        self._out = torch.zeros(out, dtype=dtype, device=self.device)

    def capture(self, dtype: torch.dtype) -> float:
        """Capture every bucket, largest first (its memory pool then serves the smaller
        ones). Every rank captures the same buckets in the same order, so their all-reduces
        pair. Returns the seconds taken."""
        t0 = time.perf_counter()
        self._graph_cls, stream_of, use_stream = piece_capture_api(self.device)
        self._size_buffers(self.buckets[-1], dtype)
        stream = stream_of(self.device)
        sets = [(self.lora, self.captured)]
        if self.lora is not None:
            sets.append((None, self.base_captured))
        for tokens in reversed(self.buckets):
            for lora, captured in sets:
                captured[tokens] = self._capture_bucket(tokens, lora, stream, use_stream)
        synchronize(self.device)
        self.seconds = time.perf_counter() - t0
        return self.seconds

    def _capture_bucket(self, tokens: int, lora, stream, use_stream) -> _Bucket:
        meta = self._warm_meta(tokens)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        # Lazy initialisations outside the capture.
        with forward_context(ctx), static_scope(lora, tokens):
            self.model(self.ids[:tokens], self.positions[:tokens])
        synchronize(self.device)
        bucket = _Bucket()
        with use_stream(stream):
            ctx = ForwardContext(meta, self.kv_caches, self.backend,
                                 pieces=Recorder(self, bucket, tokens))
            self._begin(bucket)
            try:
                with forward_context(ctx), static_scope(lora, tokens):
                    bucket.hidden = self.model(self.ids[:tokens], self.positions[:tokens])
            finally:
                bucket.graphs[-1].capture_end()
            self._pool = bucket.graphs[-1].pool()
        return bucket

    # --- serving ------------------------------------------------------------------------
    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.buckets[-1]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The model's hidden states [n, hidden] for n = len(ids) tokens: the bucket's
        pieces replayed in order, each layer's attention run eagerly in between on the
        step's own metadata. lora_slots: each token's adapter slot (-1: the base model),
        where adapters are loaded and a row of the step names one; None: the pieces
        captured without LoRA."""
        n = ids.shape[0]
        tokens = next(b for b in self.buckets if b >= n)
        base = lora_slots is None and self.lora is not None
        bucket = (self.base_captured if base else self.captured)[tokens]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        if lora_slots is not None:  # rows past n keep stale slots, as they keep stale ids
            self.lora.slot[:n].copy_(lora_slots)
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend)):
            for graph, call in zip(bucket.graphs, bucket.calls + [None], strict=True):
                graph.replay()
                if call is None:
                    break
                rope = None if call.rope is None else tuple(r[:n] for r in call.rope)
                out = call.layer.attend(call.q[:n], call.k[:n], call.v[:n], rope=rope)
                call.out[:n].copy_(out)
        return bucket.hidden[:n]
