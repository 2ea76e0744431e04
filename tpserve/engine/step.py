"""The per-step message from the driver to every shard, and rank 0's answer. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.engine.request import SamplingParams

# A token the host does not know yet: sampled by the step still running on the device
# (overlapped steps). It stands in the engine's token lists until that step is collected.
PENDING_TOKEN = -1


@dataclass
class SeqStep:
    """One sequence's share of a step: its new tokens and where they go in the paged cache."""

    seq_id: int
    token_ids: list[int]  # new tokens this step (a prompt chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    # Physical blocks of logical blocks blocks_from.. of this sequence; -1 marks a freed
    # block. Workers keep each sequence's table between steps (persistent batch state), so
    # the engine sends a table once (blocks_from = 0: replace it) and then only the blocks
    # it appended (blocks_from = how many the workers already have).
    block_table: list[int]
    sample: bool  # sample the next token after this chunk (the prompt is complete)
    params: SamplingParams | None = None
    # Tokens seen so far (prompt + generated) when a penalty needs them, else None.
    history: list[int] | None = None
    num_generated: int = 0  # seeds per-token randomness: (seed, num_generated)
    # Report the log-probability of each of token_ids[1:] (TGI's decoder_input_details).
    prompt_logprobs: bool = False
    # Encoder-decoder models only. encoder_ids is sent on the step where the decoder starts
    # from position 0 (again after a preemption): the worker runs the encoder on it and
    # writes each decoder layer's cross-attention K/V through cross_block_table. Later steps
    # read those K/V back; encoder_len says how many there are.
    encoder_ids: list[int] | None = None
    encoder_len: int = 0
    cross_block_table: list[int] = field(default_factory=list)
    blocks_from: int = 0
    # Overlapped steps: token_ids[prev_at] is PENDING_TOKEN, the token this sequence sampled
    # in the previous step; the workers take it from that step's ids on the device. -1: none.
    prev_at: int = -1
    # Guided requests: the tokens the grammar allows next, as llguidance's int32 words (bit
    # i of word w allows token 32 * w + i; numpy). Only rank 0 reads it: it samples.
    allowed: object | None = None
    # longrope models: the sequence is longer than original_max_position_embeddings, so
    # every token of it is rotated with the long factors (the workers read the rotary
    # table's long half for it); its cached keys were computed so too (Sequence.long_rope).
    long_rope: bool = False
    # LoRA: 0 for the base model, else adapter i + 1 of --lora-modules (LoraConfig.adapters).
    adapter: int = 0
    # Speculative decoding: the last num_draft of token_ids are drafted, not known. The
    # workers return the sampled token at each of the last num_draft + 1 positions, in
    # order (StepOutput.tokens holds num_draft + 1 entries for this sequence).
    num_draft: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the sequence owns after this step's update."""
        return self.blocks_from + len(self.block_table)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class StepBatch:
    step_id: int
    seqs: list[SeqStep]
    # Tests and tooling: also return the full-vocabulary logits of the sampled rows.
    return_logits: bool = False
    # Sequences finished or aborted since the last step: workers drop their tables.
    released: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top_n alternatives


@dataclass
class StepOutput:
    step_id: int
    tokens: list[SampledToken]
    # seq_id -> log p(token_ids[i+1] | ...) over the chunk, when prompt_logprobs was asked.
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)
    # seq_id -> the top_n_tokens likeliest (id, log p) at each of those positions, when the
    # request also asked for alternatives (OpenAI's echoed logprobs rank prompt tokens too).
    prompt_top: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    logits: object | None = None  # numpy [num_sampled, vocab] float32 when return_logits
