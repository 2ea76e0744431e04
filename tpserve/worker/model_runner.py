"""Runs one step on a loaded shard: prepare inputs, run the model (by replaying a decode
graph, in graph pieces around eager attention, or eagerly), compute logits, sample on rank 0.

A step is launched, then collected: launch() queues the device work and the copy of the
sampled tokens to the host and returns at once, so the engine can prepare the next step
while the device runs this one (overlapped steps). A sequence whose input token is the one
it sampled in the previous step, still unknown to the host, marks it with SeqStep.prev_at;
the runner fills it in on the device from the previous step's sampled ids (every rank keeps
them: rank 0 samples, the others receive them by a broadcast on the tensor-parallel group)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tpserve.distributed import broadcast_from_first, get_tp
from tpserve.engine.step import SeqStep, StepBatch, StepOutput
from tpserve.kernels.base import AttentionMetadata
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.layers.lora import LoraRows, lora_rows, row_slots, step_groups
from tpserve.worker.block_tables import BlockTables
from tpserve.worker.metadata import (
    HostStaging,
    build_paged_inputs,
    make_metadata,
    padded_tables,
    rope_offsets,
)
from tpserve.worker.sampling import PendingTokens, sample_async


class PendingStep:
    """A launched step's result on rank 0: result() waits for its tokens only."""

    def __init__(self, out: StepOutput, tokens: PendingTokens | None) -> None:
        self._out, self._tokens = out, tokens

    def result(self) -> StepOutput:
        if self._tokens is not None:
            self._out.tokens, self._tokens = self._tokens.tokens(), None
        return self._out


class ModelRunner:
    def __init__(self, model, kv_caches, backend, device: torch.device, rank: int,
                 block_size: int, seed: int, graphs=None, share_sampled: bool = False) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.device, self.rank, self.block_size, self.seed = device, rank, block_size, seed
        self.graphs = graphs  # DecodeGraphs (CUDA, a graph-safe backend) or None
        self.pieces = None  # PiecewiseGraphs for the other steps (CUDA) or None
        self.encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        # longrope models: where the rotary table's long-factor rows start (else None).
        self.long_rope_offset: int | None = getattr(model, "long_rope_offset", None)
        self.lora = any(getattr(m, "lora", None) is not None for m in model.modules())
        self.staging = HostStaging(device)
        self.block_tables = BlockTables()
        # Overlapped steps at tp > 1: rank 0 sends every step's sampled ids to the other
        # ranks, which need them as the next step's inputs.
        self.share_sampled = share_sampled and get_tp().size > 1
        # The previous sampling step's ids on the device and each sequence's row in them.
        self._prev_ids: torch.Tensor | None = None
        self._prev_row: dict[int, int] = {}

    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step to the end; rank 0 returns the sampled tokens, other ranks None."""
        pending = self.launch(batch)
        return None if pending is None else pending.result()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep | None:
        """Queue one step on the device; rank 0 returns its pending result, others None."""
        seqs = batch.seqs
        self.block_tables.release(batch.released)
        rows = self.block_tables.update(seqs)
        dst, src = self._prev_fill(seqs)
        q_lens = [len(s.token_ids) for s in seqs]
        # The graphs hold every adapter's delta where adapters are loaded (layers/lora.py):
        # adapter rows replay them as base rows do.
        if self.graphs is not None and self.graphs.fits(seqs):
            tables = self.block_tables.gather(rows, self.graphs.max_blocks)
            logits = self.graphs.run(seqs, tables, (dst, src, self._prev_ids))
            return self._sample(batch, logits, seqs, [])
        tables = self.block_tables.gather(rows, max(1, max(s.num_blocks for s in seqs)))
        # The hidden rows that need logits (each sampling sequence's last token, then the
        # rows of prompt log-probabilities) are known from the chunk lengths alone, so they
        # travel in the inputs' one copy: indexing with a list would copy it to the device
        # synchronously, waiting for the forward pass just queued.
        ends = list(_cumsum(q_lens))
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        # A drafted row samples at its last num_draft + 1 positions (speculative decoding).
        picks = [p for i in sampled for p in range(ends[i] - 1 - seqs[i].num_draft, ends[i])]
        lp_seqs = [i for i, s in enumerate(seqs) if s.prompt_logprobs and q_lens[i] > 1]
        for i in lp_seqs:
            picks.extend(range(ends[i] - q_lens[i], ends[i] - 1))
        adapters = [s.adapter for s in seqs] if self.lora else []
        pieces = (self.pieces is not None and not self.encoder_decoder
                  and self.pieces.fits(ends[-1])
                  and (self.pieces.lora is not None or not any(adapters)))
        # Pieces read each token's adapter slot (all of them, base rows too) where a row
        # names an adapter, and replay their set without LoRA where none does; an eager
        # step groups its adapter rows by adapter.
        groups = [] if pieces or not any(adapters) else step_groups(adapters, q_lens)
        lora_in = [row_slots(adapters, q_lens)] if pieces and any(adapters) else \
            [rows for _, rows in groups]
        inp = build_paged_inputs([s.token_ids for s in seqs], [s.start_pos for s in seqs],
                                 tables, self.block_size, self.staging,
                                 extra=[dst, src, np.asarray(picks, dtype=np.int64), *lora_in],
                                 rope_offsets=rope_offsets(seqs, self.long_rope_offset))
        d_dst, d_src, d_picks, *d_lora = inp.extra
        lora = LoraRows([(g[0], d) for g, d in zip(groups, d_lora)]) if groups else None
        if len(dst):
            inp.ids.index_copy_(0, d_dst, self._prev_ids.index_select(0, d_src))
        cross = self._encode(seqs, inp.meta) if self.encoder_decoder else None
        if pieces:
            hidden = self.pieces.run(inp.ids, inp.rope_positions, inp.meta, *d_lora)
        else:
            with forward_context(ForwardContext(inp.meta, self.kv_caches, self.backend,
                                                cross)), lora_rows(lora):
                hidden = self.model(inp.ids, inp.rope_positions)
        if not picks:
            self._prev_ids, self._prev_row = None, {}
            return PendingStep(StepOutput(batch.step_id, []), None) if self.rank == 0 else None
        logits = self.model.compute_logits(hidden.index_select(0, d_picks))
        # compute_logits may gather to rank 0 only (None elsewhere).
        return self._sample(batch, logits, _sample_rows([seqs[i] for i in sampled]), lp_seqs)

    def _prev_fill(self, seqs: list[SeqStep]) -> tuple[np.ndarray, np.ndarray]:
        """Token offsets in this step's inputs to fill from the previous step's sampled ids,
        and the rows of those ids."""
        dst, src, at = [], [], 0
        for s in seqs:
            if s.prev_at >= 0:
                row = self._prev_row.get(s.seq_id)
                if row is None:
                    raise RuntimeError(f"step input of sequence {s.seq_id} refers to a token "
                                       "the previous step did not sample for it")
                dst.append(at + s.prev_at)
                src.append(row)
            at += len(s.token_ids)
        return np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)

    def _sample(self, batch: StepBatch, logits: torch.Tensor | None, picked: list[SeqStep],
                lp_seqs: list[int]) -> PendingStep | None:
        """logits (the model's dtype; the sampler widens what it needs): the rows of `picked`
        (the sequences that sample), then each lp_seqs chunk's rows but the last; None on
        ranks that do not sample."""
        n = len(picked)
        ids, tokens = None, None
        if self.rank == 0 and logits is not None:
            tokens = sample_async(logits[:n], picked, self.seed) if n else None
            ids = tokens.ids if tokens is not None else None
        if self.share_sampled and n:
            if ids is None:
                ids = torch.empty(n, dtype=torch.int64, device=self.device)
            broadcast_from_first(ids)
        self._prev_ids = ids
        self._prev_row = ({s.seq_id: i for i, s in enumerate(picked) if not s.num_draft}
                          if ids is not None else {})
        if self.rank != 0 or logits is None:
            return None
        out = StepOutput(batch.step_id, [])
        seqs, row = batch.seqs, n
        for i in lp_seqs:
            k = len(seqs[i].token_ids) - 1
            # A recomputed chunk may end in a token still on the device (-1): its row is past
            # the prompt, whose log-probabilities are all that is kept.
            nxt = torch.tensor([max(t, 0) for t in seqs[i].token_ids[1:]],
                               device=logits.device)
            logp = logits[row : row + k].float().log_softmax(-1)
            out.prompt_logprobs[seqs[i].seq_id] = logp.gather(1, nxt[:, None])[:, 0].tolist()
            top_n = getattr(seqs[i].params, "top_n_tokens", 0) or 0
            if top_n:
                vals, ids = logp.topk(min(top_n, logp.shape[-1]), -1)
                out.prompt_top[seqs[i].seq_id] = [
                    list(zip(a, b, strict=True)) for a, b in zip(ids.tolist(), vals.tolist(),
                                                                 strict=True)]
            row += k
        if batch.return_logits:
            out.logits = logits[:n].float().cpu().numpy()
        return PendingStep(out, tokens)

    def _encode(self, seqs: list[SeqStep], meta: AttentionMetadata) -> AttentionMetadata:
        """Encoder-decoder models: run the encoder for the sequences whose decoder starts
        this step, which stores every decoder layer's cross K/V in their cross blocks; return
        the metadata cross attention reads all sequences' cross K/V with."""
        new = [i for i, s in enumerate(seqs) if s.encoder_ids is not None]
        if new:
            enc = build_paged_inputs([seqs[i].encoder_ids for i in new], [0] * len(new),
                                     padded_tables([seqs[i].cross_block_table for i in new]),
                                     self.block_size, self.staging)
            with forward_context(ForwardContext(enc.meta, self.kv_caches, self.backend)):
                self.model.encode(enc.ids, enc.rope_positions)
        enc_lens = [s.encoder_len for s in seqs]
        tables = padded_tables([s.cross_block_table for s in seqs])
        lens_d, tab_d = self.staging.to_device([np.asarray(enc_lens, dtype=np.int64), tables])
        return make_metadata(meta.query_start_loc, lens_d.int(), tab_d.view(tables.shape).int(),
                             meta.slot_mapping[:0], meta.query_lens_host, tuple(enc_lens))


def _sample_rows(seqs: list[SeqStep]) -> list[SeqStep]:
    """One entry per sampled row: a drafted sequence's once per verified position, each
    keyed as the token it would be when decoded one at a time (num_generated)."""
    if not any(s.num_draft for s in seqs):
        return seqs
    return [s if j == 0 else replace(s, num_generated=s.num_generated + j)
            for s in seqs for j in range(s.num_draft + 1)]


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
