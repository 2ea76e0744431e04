"""A request's token state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tpserve.engine.request import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Tokens whose keys/values are in the paged cache.
    num_computed: int = 0
    # Physical block per logical block; -1 where a block fell out of the sliding window.
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prefix caching: hash of each full block's token chain, filled lazily.
    block_hashes: list[int] = field(default_factory=list)
    # Encoder-decoder models: the user's prompt, fed to the encoder; prompt_ids is then the
    # decoder's prompt ([decoder_start_token_id]). None for decoder-only models.
    encoder_ids: list[int] | None = None
    # Blocks holding every decoder layer's cross-attention K/V of the encoder output
    # (ceil(len(encoder_ids) / block_size) of them, allocated with the first decoder block).
    cross_block_table: list[int] = field(default_factory=list)
    # Overlapped steps: the token sampled by the step in flight ends this sequence (its
    # length limit), so it must not be scheduled again; the engine finishes it on collect.
    hold: bool = False
    # longrope models: longer than original_max_position_embeddings when its computation
    # (re)started, so every token of it is rotated with the long factors; set by the
    # scheduler, which recomputes a sequence that grows past that length (scheduler.py).
    long_rope: bool = False
    # LoRA: 0 for the base model, else adapter i + 1 of --lora-modules (SeqStep.adapter).
    adapter: int = 0
    # Speculative decoding: tokens proposed to follow this step's input, verified by the
    # step that feeds them (the scheduler schedules them after the pending token).
    draft: list[int] = field(default_factory=list)

    @property
    def num_input_tokens(self) -> int:
        """The prompt as the user sent it: the encoder input, or the decoder-only prompt."""
        return len(self.encoder_ids) if self.encoder_ids is not None else len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (a prompt, a prompt's rest, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
