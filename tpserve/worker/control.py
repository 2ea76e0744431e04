"""The per-step control channel from rank 0 to ranks 1..tp-1.

Rank 0 runs the step the engine sends it and broadcasts what the other ranks need to run the
same step (they meet in the all-reduces) over a CPU (gloo) process group created next to the
tensor-parallel group, so it works across nodes and carries its own timeout. The message is
one int64 array, not a pickled dataclass: the other ranks need positions, tokens and block
tables, never sampling parameters (only rank 0 samples).

Layout: [STEP, step_id, n, n_released] then n rows of FIELDS, then every sequence's
token_ids, block table (from blocks_from on), encoder_ids and cross block table, in that
order, then the released sequence ids. [STOP] ends the follower loop.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tpserve.engine.step import SeqStep, StepBatch

STEP, STOP = 1, 2
# seq_id, start_pos, n_tokens, blocks_from, n_blocks, sample, prompt_logprobs, n_encoder,
# encoder_len, n_cross, prev_at, long_rope, adapter, num_draft
FIELDS = 14


def encode_step(batch: StepBatch) -> np.ndarray:
    rows = np.empty((len(batch.seqs), FIELDS), dtype=np.int64)
    tail: list[list[int]] = []
    for i, s in enumerate(batch.seqs):
        enc = s.encoder_ids or []
        rows[i] = (s.seq_id, s.start_pos, len(s.token_ids), s.blocks_from,
                   len(s.block_table), s.sample, s.prompt_logprobs, len(enc), s.encoder_len,
                   len(s.cross_block_table), s.prev_at, s.long_rope, s.adapter,
                   s.num_draft)
        tail += [s.token_ids, s.block_table, enc, s.cross_block_table]
    tail.append(batch.released)
    flat = np.fromiter((x for part in tail for x in part), dtype=np.int64)
    head = np.array([STEP, batch.step_id, len(batch.seqs), len(batch.released)],
                    dtype=np.int64)
    return np.concatenate([head, rows.reshape(-1), flat])


def decode_step(msg: np.ndarray) -> StepBatch:
    step_id, n, n_released = int(msg[1]), int(msg[2]), int(msg[3])
    rows = msg[4 : 4 + n * FIELDS].reshape(n, FIELDS).tolist()
    flat = msg[4 + n * FIELDS :].tolist()
    at, seqs = 0, []

    def take(k: int) -> list[int]:
        nonlocal at
        at += k
        return flat[at - k : at]

    for seq_id, start, n_tok, blocks_from, n_blocks, sample, plp, n_enc, enc_len, n_cross, \
            prev_at, long_rope, adapter, num_draft in rows:
        token_ids, table, enc, cross = take(n_tok), take(n_blocks), take(n_enc), take(n_cross)
        seqs.append(SeqStep(seq_id=seq_id, token_ids=token_ids, start_pos=start,
                            block_table=table, sample=bool(sample), prompt_logprobs=bool(plp),
                            encoder_ids=enc if n_enc else None, encoder_len=enc_len,
                            cross_block_table=cross, blocks_from=blocks_from,
                            prev_at=prev_at, long_rope=bool(long_rope), adapter=adapter,
                            num_draft=num_draft))
    return StepBatch(step_id, seqs, released=take(n_released))


class ControlChannel:
    """Broadcast of one int64 array per step from rank 0 (length first, then the data)."""

    def __init__(self, tp_size: int, timeout_s: float) -> None:
        self.group = dist.new_group(list(range(tp_size)), backend="gloo",
                                    timeout=timedelta(seconds=timeout_s))
        self._len = torch.zeros(1, dtype=torch.int64)

    def send(self, msg: np.ndarray) -> None:
        self._len[0] = msg.size
        dist.broadcast(self._len, src=0, group=self.group)
        dist.broadcast(torch.from_numpy(msg), src=0, group=self.group)

    def recv(self) -> np.ndarray:
        dist.broadcast(self._len, src=0, group=self.group)
        buf = torch.empty(int(self._len[0]), dtype=torch.int64)
        dist.broadcast(buf, src=0, group=self.group)
        return buf.numpy()

    def send_stop(self) -> None:
        self.send(np.array([STOP], dtype=np.int64))
