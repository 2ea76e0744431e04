"""Continuous batching: every step decodes the running sequences and admits waiting ones
(prompts, chunked to the token budget) in arrival order. When the KV cache runs out, the
youngest running sequence is preempted and later recomputed from its tokens.

longrope models (Phi-3-*-128k, Phi-3.5, Phi-4-mini) rotate a sequence of at most
original_max_position_embeddings tokens with the short factors and a longer one with the
long factors, every token of it: transformers' generate drops its KV cache when a sequence
grows past that length and recomputes it. A running sequence that grows past it is
preempted the same way, so its recompute starts over with the long factors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tpserve.engine.block_manager import BlockManager
from tpserve.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens fed this step, starting at seq.num_computed (drafts included)
    num_draft: int = 0  # the last num_draft of them are seq.draft[:num_draft]

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every known token is in the cache, so a next token is sampled."""
        return self.seq.num_computed + self.num_new - self.num_draft == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, sliding_window: int | None = None,
                 longrope_original: int | None = None, max_loras: int = 0) -> None:
        """max_loras: most distinct LoRA adapters among the running sequences (0: no limit;
        every step's adapters are among them)."""
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sliding_window = sliding_window
        # longrope models: the longest sequence the short factors rotate (else None).
        self.longrope_original = longrope_original
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and return its blocks."""
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.draft = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _grew_past_short_rope(self, seq: Sequence) -> bool:
        """A longrope sequence computed with the short factors that is now longer than they
        serve: its cached keys are rotated otherwise than its next token must see them."""
        return (self.longrope_original is not None and not seq.long_rope
                and seq.num_tokens > self.longrope_original)

    def _start_rope(self, seq: Sequence) -> None:
        """Fix the factor set a sequence is (re)computed with, before its first block."""
        long = self.longrope_original is not None and seq.num_tokens > self.longrope_original
        if long != seq.long_rope:
            seq.long_rope = long
            seq.block_hashes = []  # they name blocks of the other factor set (prefix_cache)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        blocks, running_status = self.blocks, SeqStatus.RUNNING
        can_grow, grow = blocks.can_grow, blocks.grow
        # Running sequences first, oldest first; make room by preempting the youngest.
        for seq in list(self.running):
            if seq.status is not running_status or seq.hold:
                continue  # preempted earlier in this loop, or its last token is in flight
            if budget <= 0:
                break
            if self._grew_past_short_rope(seq):
                self._preempt(seq)  # recomputed with the long factors (admitted below)
                continue
            n = seq.num_pending
            if n > budget:
                n = budget
            # Drafts follow a sequence's one pending token, as far as the budget goes.
            k = min(len(seq.draft), budget - n) if n == 1 and seq.draft else 0
            if k and not can_grow(seq, seq.num_computed + n + k):
                k = 0  # its drafts alone never make a sequence preempt another
            n += k
            upto = seq.num_computed + n
            while not can_grow(seq, upto):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not running_status:
                continue
            grow(seq, upto)
            out.append(ScheduledSeq(seq, n, k))
            budget -= n
        # Then admit waiting sequences in arrival order, without skipping ahead.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.hold:  # a preempted sequence whose last token is in flight: it ends soon
                break
            if not self._adapter_fits(seq):
                break  # in order: it waits until a running adapter's sequences finish
            fresh = seq.num_computed == 0
            if fresh:
                self._start_rope(seq)
                self.blocks.reuse_prefix(seq)  # cached blocks count as computed
            n = min(seq.num_pending, budget)
            if not self.blocks.can_grow(seq, seq.num_computed + n):
                if fresh:  # hand back what reuse_prefix attached: a waiting sequence
                    self.blocks.free(seq)  # holding blocks could starve the running ones
                    seq.num_computed = 0
                break
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            # An encoder runs whole on the step its decoder starts. Charged after admission,
            # so an encoder input longer than the whole budget still gets in (it leaves no
            # budget for later admissions) instead of waiting forever.
            budget -= n + (len(seq.encoder_ids) if seq.encoder_ids is not None
                           and seq.num_computed == 0 else 0)
        return out

    def _adapter_fits(self, seq: Sequence) -> bool:
        if not seq.adapter or not self.max_loras:
            return True
        active = {s.adapter for s in self.running if s.adapter}
        return seq.adapter in active or len(active) < self.max_loras

    def after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Record what the step computed; release blocks that left the sliding window."""
        for s in scheduled:
            # Drafts count once verified: EngineCore adds the accepted ones on collect.
            s.seq.num_computed += s.num_new - s.num_draft
            self.blocks.after_compute(s.seq)
            if self.sliding_window and not s.seq.finished:
                # A prompt being scored starts each chunk at the last token computed
                # (EngineCore._seq_step), whose query sees one key further back.
                scored = 1 if s.seq.params.prompt_logprobs else 0
                self.blocks.release_outside_window(s.seq, self.sliding_window + scored)

    def can_ever_fit(self, num_tokens: int, encoder_tokens: int = 0) -> bool:
        """Whether one sequence of num_tokens (decoder) tokens, plus the cross K/V of
        encoder_tokens encoder outputs, could run alone in the whole cache."""
        if self.sliding_window:
            num_tokens = min(num_tokens, self.sliding_window + self.max_num_batched_tokens)
        bs = self.blocks.block_size
        return -(-num_tokens // bs) + -(-encoder_tokens // bs) <= self.blocks.num_blocks
