"""Decode steps captured as CUDA graphs, one per batch-size bucket, during warmup.

A decode step launches a few hundred small kernels from Python; replaying a captured graph
launches them in one call, which is what makes small batches approach the memory roofline.
Only decode-only steps are captured (prefill shapes vary too much); the model, the
all-reduces and the LM head run inside the graph, sampling outside it. Rows of a bucket that
the step does not fill point at a scratch KV block that no sequence owns.

With LoRA adapters loaded, each graph also holds every adapter's delta in its masked form
(layers/lora.py), and each row's adapter slot is one more static input: a step of adapter
rows, or of adapter and base rows, replays that graph. Every bucket is also captured a second
time without any LoRA op, and a step in which no row names an adapter replays that one: the
masked form computes every loaded adapter for every row (three launches per LoRA layer, 384 a
Llama-3-8B step), which made a server with adapters loaded 1.2-1.4x slower per decode step for
base-model requests too (docs/lora.md, "Speed"). The price is one more logits buffer per
bucket (bucket x vocab x dtype bytes; ~0.37 GB summed over the buckets up to 256 for a 128k
vocabulary in bf16) and the capture time of a second set. Without adapters nothing of LoRA is
captured.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from tpserve.cluster.device import graph_api, synchronize
from tpserve.engine.step import SeqStep
from tpserve.kernels.base import AttentionMetadata
from tpserve.kernels.gemm_tuning import GemmTuning
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.layers.lora import StaticLoraRows, static_scope
from tpserve.worker.metadata import HostStaging, make_metadata, rope_offsets

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: powers of two up to 8, then steps of 8 to 32, 16 to 128, 32 to
    256 and 64 beyond, and max_batch itself. 129 sequences replay the 160 graph, not 256;
    about 17 graphs up to 256 keep capture time bounded."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b += b if b < 16 else 8 if b < 32 else 16 if b < 128 else 32 if b < 256 else 64
    sizes.append(max(1, max_batch))
    return tuple(sizes)


def graphs_supported(device: torch.device, backend, encoder_decoder: bool) -> str | None:
    """None when decode graphs can be captured here, else why not."""
    if graph_api(device) is None:
        return f"graphs are captured on CUDA only (device is {device.type})"
    if not getattr(backend, "cuda_graph_safe", False):
        return f"the {backend.name} backend is not marked cuda_graph_safe"
    if encoder_decoder:
        return "encoder-decoder models run eagerly"
    return None


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, device: torch.device, buckets: tuple[int, ...],
                 max_blocks: int, block_size: int, scratch_block: int) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks, self.block_size, self.scratch = max_blocks, block_size, scratch_block
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        # The rotary's positions (a graph input, refilled every step): the true positions
        # plus each sequence's rope offset (longrope's long-factor rows).
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.long_rope_offset: int | None = getattr(model, "long_rope_offset", None)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        # Each row's adapter slot (-1: base model or padding); None without adapters.
        self.lora = StaticLoraRows.of(model, n, device)
        self.device = device
        self.staging = HostStaging(device)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        # With adapters: the same buckets without LoRA, for steps of base-model rows only.
        self.base_graphs: dict[int, tuple[object, torch.Tensor]] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return make_metadata(self.starts[: b + 1], self.seq_lens[:b], self.tables[:b],
                             self.slots[:b], (1,) * b, (), self.max_blocks * self.block_size)

    def _forward(self, b: int, lora: bool = True) -> torch.Tensor:
        """lora=False: the base model alone (no LoRA op), whatever adapters are loaded."""
        ctx = ForwardContext(self._meta(b), self.kv_caches, self.backend)
        with forward_context(ctx), static_scope(self.lora if lora else None, b):
            hidden = self.model(self.ids[:b], self.positions[:b])
        return self.model.compute_logits(hidden)

    def _fill_padding(self) -> None:
        self.ids.zero_()
        self.positions.zero_()
        self.slots.fill_(self.scratch * self.block_size)
        self.tables.fill_(self.scratch)
        self.seq_lens.fill_(1)
        if self.lora is not None:
            self.lora.slot.fill_(-1)

    def capture(self, tuning: GemmTuning | None = None) -> float:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool.
        Every rank captures the same buckets in the same order, so their collectives pair.
        tuning: times the GEMM algorithms of each bucket's eager run (gemm_tuning.py), so
        the graph captures the fastest."""
        t0 = time.perf_counter()
        graph_cls, capturing = graph_api(self.device)
        self._fill_padding()
        pool = None
        # Without adapters the first set is already the base model's.
        sets = [(True, self.graphs)] + ([(False, self.base_graphs)] if self.lora is not None else [])
        for b in reversed(self.buckets):
            # Lazy initialisations (cuBLAS workspaces, NCCL) happen outside the capture.
            with tuning.tune(b) if tuning is not None else contextlib.nullcontext():
                self._forward(b)
            synchronize(self.device)
            for lora, graphs in sets:
                if not lora:
                    self._forward(b, lora=False)  # the fast paths LoRA turned off, warmed
                    synchronize(self.device)
                graph = graph_cls()
                with capturing(graph, pool=pool):
                    out = self._forward(b, lora)
                pool = graph.pool()
                graphs[b] = (graph, out)
        synchronize(self.device)
        return time.perf_counter() - t0

    def fits(self, seqs: list[SeqStep]) -> bool:
        return (len(seqs) <= self.buckets[-1]
                and all(len(s.token_ids) == 1 and s.sample and not s.prompt_logprobs
                        and s.num_blocks <= self.max_blocks
                        and (self.lora is not None or not s.adapter) for s in seqs))

    def run(self, seqs: list[SeqStep], seq_tables: np.ndarray,
            prev: tuple[np.ndarray, np.ndarray, torch.Tensor | None] | None = None
            ) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] of one decode step, replayed from the smallest bucket
        that holds the batch; seq_tables: [len(seqs), max_blocks] block ids. prev: (rows,
        indices into ids, ids): those rows' input tokens are the previous step's sampled ids,
        on the device (overlapped steps)."""
        b = len(seqs)
        bucket = next(x for x in self.buckets if x >= b)
        # The whole bucket goes over in one copy, padding rows included: they point at the
        # scratch block, so rows a larger previous batch left behind never write real blocks.
        bs = self.block_size
        pos = np.zeros(bucket, dtype=np.int64)
        pos[:b] = [s.start_pos for s in seqs]
        ids = np.zeros(bucket, dtype=np.int64)
        ids[:b] = [s.token_ids[0] for s in seqs]
        tables = np.full((bucket, self.max_blocks), self.scratch, dtype=np.int64)
        tables[:b] = seq_tables
        slots = tables[np.arange(bucket), pos // bs] * bs + pos % bs
        rope = pos
        offsets = rope_offsets(seqs, self.long_rope_offset)
        if offsets is not None:
            rope = pos.copy()
            rope[:b] += offsets
        dst, src, prev_ids = prev if prev is not None else (np.zeros(0, np.int64),) * 2 + (None,)
        arrays = [ids, rope, slots, pos + 1, tables, dst, src]
        base = self.base_graphs and not any(s.adapter for s in seqs)
        if self.lora is not None and not base:  # padded rows: -1, no adapter's delta
            adapter = np.zeros(bucket, dtype=np.int64)
            adapter[:b] = [s.adapter for s in seqs]
            arrays.append(adapter - 1)
        ids_d, pos_d, slots_d, lens_d, tab_d, dst_d, src_d, *lora_d = self.staging.to_device(
            arrays)
        self.ids[:bucket].copy_(ids_d)
        if len(dst):
            self.ids.index_copy_(0, dst_d, prev_ids.index_select(0, src_d))
        self.positions[:bucket].copy_(pos_d)
        self.slots[:bucket].copy_(slots_d)
        self.seq_lens[:bucket].copy_(lens_d)
        self.tables[:bucket].copy_(tab_d.view(bucket, self.max_blocks))
        if lora_d:
            self.lora.slot[:bucket].copy_(lora_d[0])
        graph, out = (self.base_graphs if base else self.graphs)[bucket]
        graph.replay()
        return None if out is None else out[:b]  # None: logits gathered to rank 0 only
