"""Runs one step on a loaded shard: prepare inputs, run the model (eagerly or by replaying a
decode graph), compute logits, sample on rank 0."""

from __future__ import annotations

import numpy as np
import torch

from tpserve.engine.step import SeqStep, StepBatch, StepOutput
from tpserve.kernels.base import AttentionMetadata
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.worker.block_tables import BlockTables
from tpserve.worker.metadata import HostStaging, build_paged_inputs, make_metadata, padded_tables
from tpserve.worker.sampling import sample_tokens


class ModelRunner:
    def __init__(self, model, kv_caches, backend, device: torch.device, rank: int,
                 block_size: int, seed: int, graphs=None) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.device, self.rank, self.block_size, self.seed = device, rank, block_size, seed
        self.graphs = graphs  # DecodeGraphs (CUDA, a graph-safe backend) or None
        self.encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        self.staging = HostStaging(device)
        self.block_tables = BlockTables()

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Rank 0 returns the sampled tokens, other ranks None."""
        seqs = batch.seqs
        self.block_tables.release(batch.released)
        rows = self.block_tables.update(seqs)
        if self.graphs is not None and self.graphs.fits(seqs):
            tables = self.block_tables.gather(rows, self.graphs.max_blocks)
            logits = self.graphs.run(seqs, tables)
            return self._sample(batch, None if logits is None else logits.float(), [], [])
        tables = self.block_tables.gather(rows, max(1, max(s.num_blocks for s in seqs)))
        inp = build_paged_inputs([s.token_ids for s in seqs], [s.start_pos for s in seqs],
                                 tables, self.block_size, self.staging)
        cross = self._encode(seqs, inp.meta) if self.encoder_decoder else None
        with forward_context(ForwardContext(inp.meta, self.kv_caches, self.backend, cross)):
            hidden = self.model(inp.ids, inp.positions)
        q_lens = inp.meta.query_lens_host
        ends = list(_cumsum(q_lens))
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        rows = [ends[i] - 1 for i in sampled]
        lp_seqs = [i for i, s in enumerate(seqs) if s.prompt_logprobs and q_lens[i] > 1]
        for i in lp_seqs:
            rows.extend(range(ends[i] - q_lens[i], ends[i] - 1))
        if not rows:
            return StepOutput(batch.step_id, []) if self.rank == 0 else None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        # compute_logits may gather to rank 0 only (None elsewhere).
        return self._sample(batch, None if logits is None else logits.float(), sampled, lp_seqs)

    def _sample(self, batch: StepBatch, logits: torch.Tensor | None, sampled: list[int],
                lp_seqs: list[int]) -> StepOutput | None:
        """logits: the sampled rows (every row when `sampled` is empty and no prompt
        logprobs: a decode graph), then each lp_seqs chunk's rows but the last."""
        if self.rank != 0 or logits is None:
            return None
        seqs = batch.seqs
        picked = [seqs[i] for i in sampled] if sampled or lp_seqs else seqs
        n = len(picked)
        out = StepOutput(batch.step_id,
                         sample_tokens(logits[:n], picked, self.seed) if n else [])
        row = n
        for i in lp_seqs:
            k = len(seqs[i].token_ids) - 1
            nxt = torch.tensor(seqs[i].token_ids[1:], device=logits.device)
            lps = logits[row : row + k].log_softmax(-1).gather(1, nxt[:, None])[:, 0]
            out.prompt_logprobs[seqs[i].seq_id] = lps.tolist()
            row += k
        if batch.return_logits:
            out.logits = logits[:n].cpu().numpy()
        return out

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
                self.model.encode(enc.ids, enc.positions)
        enc_lens = [s.encoder_len for s in seqs]
        tables = padded_tables([s.cross_block_table for s in seqs])
        lens_d, tab_d = self.staging.to_device([np.asarray(enc_lens, dtype=np.int64), tables])
        return make_metadata(meta.query_start_loc, lens_d.int(), tab_d.view(tables.shape).int(),
                             meta.slot_mapping[:0], meta.query_lens_host, tuple(enc_lens))


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
