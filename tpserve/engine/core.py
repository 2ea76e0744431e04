"""The engine core: admission, scheduling, one step through the Executor, and the stop rules
that free KV blocks (EOS and length). Token ids in, token ids out: no tokenizer and no text
(the output processor owns those and every stop-string rule). Synchronous and torch-free;
the executor is built by whoever launches the engine (tpserve/cluster/driver.py, tests)."""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tpserve.config import EngineConfig
from tpserve.engine.block_manager import BlockManager
from tpserve.engine.guided import Grammars, GuidedMatcher, GuidedVocab
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import ScheduledSeq, Scheduler
from tpserve.engine.sequence import Sequence
from tpserve.engine.speculative import accepted, draft, draft_budget, skip_after, speculates
from tpserve.engine.step import PENDING_TOKEN, SeqStep, StepBatch, StepOutput
from tpserve.errors import CheckpointError, TPServeError, ValidationError
from tpserve.lora_config import unknown_adapter

if TYPE_CHECKING:  # the engine sees the interface only; the launcher builds the executor
    from tpserve.executor.base import Executor

log = logging.getLogger(__name__)


@dataclass
class CoreRequest:
    seq: Sequence
    # (token id, log p, the top_n_tokens alternatives as (id, log p)) of each prompt token
    # when prompt_logprobs was asked; the first has neither.
    prefill: list[tuple[int, float | None, list[tuple[int, float]]]] = field(
        default_factory=list)
    prefill_sent: bool = False
    # The block table the workers hold for this sequence (the list object, which the block
    # manager replaces when it frees a sequence) and how many of its blocks they have.
    sent_table: list[int] | None = None
    sent_blocks: int = 0
    # Tokens at the end of seq.output_ids still on the device (PENDING_TOKEN): sampled by
    # launched steps not yet collected (overlapped steps).
    unresolved: int = 0
    # Guided requests: where the grammar is, advanced by every collected token.
    matcher: GuidedMatcher | None = None
    # Speculative decoding: lookups that missed in a row, steps left without one, and the
    # sequence's tokens as the int32 array its lookups search (grown as it is).
    spec_misses: int = 0
    spec_skip: int = 0
    spec_tokens: array = field(default_factory=lambda: array("i"))


@dataclass
class _Launched:
    """A step on the device, not yet collected."""

    handle: object  # the executor's
    sync: bool  # must be collected before the next step is scheduled
    # seq id -> the prompt position of the first log-probability its chunk reports
    scored: dict[int, int] = field(default_factory=dict)
    # seq id -> the drafts its row verifies (speculative decoding)
    drafts: dict[int, list[int]] = field(default_factory=dict)


def _longrope_original(hf_config) -> int | None:
    """original_max_position_embeddings of a longrope (Phi-3 long-context) model, else None."""
    if getattr(hf_config, "is_encoder_decoder", False):
        return None
    from tpserve.hf_config import longrope_original, rope_parameters

    return longrope_original(rope_parameters(hf_config))


def decoder_start_token_id(path: str, hf_config) -> int:
    """The first decoder token of an encoder-decoder model, found where transformers'
    generate looks: the config, generation_config.json, then bos; T5 uses pad."""
    gen = Path(path) / "generation_config.json"
    gen_cfg = json.loads(gen.read_text()) if gen.exists() else {}
    for v in (getattr(hf_config, "decoder_start_token_id", None),
              gen_cfg.get("decoder_start_token_id"), getattr(hf_config, "bos_token_id", None),
              getattr(hf_config, "pad_token_id", None)):
        if isinstance(v, int):
            return v
    raise CheckpointError(f"{path}: an encoder-decoder model needs decoder_start_token_id in "
                          "config.json or generation_config.json")


class EngineCore:
    def __init__(self, cfg: EngineConfig, executor: Executor, hf_config,
                 eos_ids: set[int]) -> None:
        """hf_config: the checkpoint's transformers config; eos_ids: the token ids that end
        a sequence (eos_token_ids() gathers them from the checkpoint and the tokenizer)."""
        self.cfg = cfg
        self.executor = executor
        try:
            self._setup(cfg, hf_config, eos_ids)
        except BaseException:
            executor.shutdown()  # no shard actors or placement groups left behind
            raise
        self.requests: dict[int, CoreRequest] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()
        self.steps_run = 0
        # Cumulative step timing (gauges; a benchmark takes differences across a burst):
        # seconds inside step(), the part of it spent waiting for the device to finish a
        # step (collect), steps that prefilled something, and tokens computed.
        self.busy_seconds = 0.0
        self.device_wait_seconds = 0.0
        self.prefill_steps = 0
        self.step_tokens = 0
        # Speculative decoding: drafted tokens sent for verification, and those accepted.
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self._released: list[int] = []  # finished since the last step: workers drop tables
        # Overlapped steps: step n+1 is scheduled and launched before step n is collected.
        self.overlap = cfg.scheduler.async_scheduling
        self._inflight: _Launched | None = None
        # Guided decoding: compiled grammars, once the tokenizer's vocabulary is known
        # (set_guided_vocab: the driver holds the tokenizer).
        self.grammars = Grammars(None)

    def set_guided_vocab(self, vocab: GuidedVocab | None) -> None:
        self.grammars = Grammars(vocab)

    def _setup(self, cfg: EngineConfig, hf_config, eos_ids: set[int]) -> None:
        self.hf_config = hf_config
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = cfg.model.max_model_len
        # Encoder-decoder: the prompt feeds the encoder; the decoder starts from one token.
        self.encoder_decoder = bool(getattr(self.hf_config, "is_encoder_decoder", False))
        self.decoder_start = (decoder_start_token_id(cfg.model.path, self.hf_config)
                              if self.encoder_decoder else None)
        self.longrope_original = _longrope_original(hf_config)
        self.spec = cfg.speculative if cfg.speculative.method else None
        if self.spec is not None and self.encoder_decoder:
            raise ValueError(
                f"--speculative {self.spec.method} serves decoder-only models; "
                f"{cfg.model.path} is an encoder-decoder model "
                f"({getattr(hf_config, 'model_type', '?')}): leave --speculative off")
        if self.longrope_original is not None and self.max_model_len > self.longrope_original:
            log.info("rope_type longrope: a sequence longer than %d tokens (the model's "
                     "original_max_position_embeddings) is rotated with long_factor "
                     "throughout; one that grows past it is recomputed once, as transformers "
                     "does", self.longrope_original)
        self.max_input_tokens = min(cfg.scheduler.max_input_tokens or self.max_model_len - 1,
                                    self.max_model_len - 1)
        self._start_executor(cfg)
        window = self._common_window()
        self.scheduler = Scheduler(self._block_manager(window),
                                   cfg.scheduler.max_num_seqs,
                                   cfg.scheduler.max_num_batched_tokens, window,
                                   self.longrope_original, cfg.lora.max_loras)
        self.adapter_ids = {name: i + 1 for i, name in enumerate(cfg.lora.names)}

    def _start_executor(self, cfg: EngineConfig) -> None:
        executor = self.executor
        t0 = time.perf_counter()
        self.load_reports = executor.start()
        r0 = self.load_reports[0]
        log.info("weights loaded in %.1fs: %.1f MB per shard; attention backend %s%s",
                 time.perf_counter() - t0, r0.param_bytes / 1e6, r0.backend,
                 "".join(f"; passed over {k}: {v}" for k, v in r0.passed_over.items()))
        num_blocks = executor.available_blocks()
        full = -(-self.max_model_len // cfg.cache.block_size)
        if num_blocks == 0:
            raise RuntimeError(
                "no memory is left for the KV cache after loading the weights; raise "
                "--kv-cache-memory-gb (CPU) or --gpu-memory-utilization, use more shards (--tp), "
                "or set --num-blocks")
        if num_blocks < full:
            log.warning("the KV cache (%d blocks of %d tokens) cannot hold one request of "
                        "--max-total-tokens %d; longer requests will be refused", num_blocks,
                        cfg.cache.block_size, self.max_model_len)
        executor.allocate_cache(num_blocks)
        self.num_blocks = num_blocks
        # Imported here: tpserve.kernels pulls in torch, which the engine module must not.
        from tpserve.kernels.compile_cache import warmup_batch_sizes

        buckets = warmup_batch_sizes(cfg.scheduler.max_num_seqs)
        self.warmup_seconds = executor.warmup(buckets)
        log.info("warmup (kernel compilation) took %.2fs for batch sizes %s",
                 self.warmup_seconds, ",".join(map(str, buckets)))
        log.info("KV cache: %d blocks x %d tokens per shard, %s (--kv-cache-dtype %s), %d "
                 "bytes per block", num_blocks, cfg.cache.block_size, r0.cache_dtype or "?",
                 cfg.cache.kv_cache_dtype, r0.cache_bytes_per_block)

    def _block_manager(self, window: int | None) -> BlockManager:
        if not self.cfg.cache.prefix_caching:
            return BlockManager(self.num_blocks, self.cfg.cache.block_size)
        if self.encoder_decoder or any(self.load_reports[0].windows):
            log.warning("--prefix-caching is off for this model: it covers decoder-only "
                        "models without a sliding window")
            return BlockManager(self.num_blocks, self.cfg.cache.block_size)
        log.info("prefix caching on: full KV blocks are shared across requests")
        return PrefixCachingBlockManager(self.num_blocks, self.cfg.cache.block_size)

    def _common_window(self) -> int | None:
        """The window blocks may leave the cache by: the one every layer attends within, as
        the model was built (rank 0's load report), not as config.json reads (transformers'
        Llama ignores a sliding_window key there); None when any layer sees everything."""
        windows = set(self.load_reports[0].windows)
        return windows.pop() if len(windows) == 1 else None

    # --- requests -----------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValidationError("`inputs` tokenizes to zero tokens; send a non-empty prompt")
        if n > self.max_input_tokens:
            raise ValidationError(f"`inputs` must have at most {self.max_input_tokens} tokens. "
                                  f"Given: {n}. Shorten the prompt or set `truncate`.")
        if n + params.max_new_tokens > self.max_model_len:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.max_model_len}. "
                f"Given: {n} `inputs` tokens and {params.max_new_tokens} `max_new_tokens`")
        if params.adapter is not None and params.adapter not in self.adapter_ids:
            raise ValidationError(unknown_adapter(params.adapter, self.cfg.lora.names))
        vocab = getattr(self.hf_config, "vocab_size", None)
        # Ids past the embedding would fail the whole step at tp 1 (an index error for every
        # request in it) and read zeros at tp > 1 (each rank masks what it does not hold).
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or (vocab and hi >= vocab):
            tid = lo if lo < 0 else hi
            ids = f"ids 0 to {vocab - 1}" if vocab else "ids are not negative"
            raise ValidationError(
                f"`inputs` holds token id {tid}, which is not in the model's vocabulary "
                f"({ids}): token ids sent directly must be below the model's vocab_size; a "
                f"tokenizer that makes such ids does not match the checkpoint's config.json")
        bad = [tid for tid, _ in params.logit_bias if tid < 0 or (vocab and tid >= vocab)]
        if bad:
            raise ValidationError(f"`logit_bias` names token id {bad[0]}, which is not in the "
                                  f"model's vocabulary (ids 0 to {vocab - 1})")
        fits = (self.scheduler.can_ever_fit(1 + params.max_new_tokens, encoder_tokens=n)
                if self.encoder_decoder else self.scheduler.can_ever_fit(n + params.max_new_tokens))
        if not fits:
            raise ValidationError(
                f"a request of {n + params.max_new_tokens} tokens does not fit in this server's "
                f"KV cache ({self.num_blocks} blocks of {self.cfg.cache.block_size} tokens)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.validate(prompt_ids, params)
        if not params.greedy and params.seed is None:
            # Report the seed actually used, as TGI does, so a sample can be replayed.
            params = replace(params, seed=random.getrandbits(63))
        if self.encoder_decoder:
            seq = Sequence(next(self._ids), [self.decoder_start], params,
                           encoder_ids=list(prompt_ids))
        else:
            seq = Sequence(next(self._ids), list(prompt_ids), params)
        seq.adapter = self.adapter_ids.get(params.adapter, 0)
        state = CoreRequest(seq)
        if params.guided is not None:  # ValidationError when the grammar does not compile
            state.matcher = self.grammars.matcher(params.guided)
        if params.prompt_logprobs:
            # Nothing predicts the first token (an encoder-decoder's decoder start token, the
            # whole of its decoder input): it has no log-probability, and a one-token prompt
            # gets no step that reports any.
            state.prefill.append((seq.prompt_ids[0], None, []))
        self.requests[seq.seq_id] = state
        self.scheduler.add(seq)
        return seq

    def add_requests(self, requests: list[tuple[list[int], SamplingParams]]
                     ) -> list[Sequence | TPServeError]:
        """Several requests at once: each one's Sequence, or the error that refused it."""
        out: list[Sequence | TPServeError] = []
        for prompt_ids, params in requests:
            try:
                out.append(self.add_request(prompt_ids, params))
            except TPServeError as exc:
                out.append(exc)
        return out

    def abort(self, seq_id: int) -> None:
        state = self.requests.pop(seq_id, None)
        if state is not None:
            _drop_pending(state)
            self.scheduler.finish(state.seq)
            self._released.append(seq_id)

    def has_work(self) -> bool:
        return len(self.scheduler) > 0 or self._inflight is not None

    def stats(self) -> dict[str, float]:
        """Scheduler and KV-cache gauges (each a single read: safe from another thread)."""
        s = self.scheduler
        return {"running_sequences": len(s.running), "waiting_sequences": len(s.waiting),
                "kv_blocks_free": s.blocks.num_free, "kv_blocks_total": s.blocks.num_blocks,
                "prefix_cache_hit_blocks": float(getattr(s.blocks, "hits", 0)),
                "work_tokens": float(work_tokens([*s.running, *s.waiting])),
                **self.counters()}

    def counters(self) -> dict[str, float]:
        """The cumulative step counters alone: cheap enough to read on every poll."""
        return {"steps": float(self.steps_run), "step_busy_seconds": self.busy_seconds,
                "step_device_wait_seconds": self.device_wait_seconds,
                "prefill_steps": float(self.prefill_steps),
                "step_tokens": float(self.step_tokens),
                "spec_draft_tokens": float(self.spec_draft_tokens),
                "spec_accepted_tokens": float(self.spec_accepted_tokens)}

    # --- one step -----------------------------------------------------------------------
    def _seq_step(self, s: ScheduledSeq) -> SeqStep:
        seq, p = s.seq, s.seq.params
        start = seq.num_computed
        # Workers keep tables between steps: send a new (or, after preemption, replaced)
        # table whole, later only the blocks appended since.
        state = self.requests[seq.seq_id]
        if state.sent_table is not seq.block_table:
            state.sent_table, state.sent_blocks = seq.block_table, 0
        blocks_from, state.sent_blocks = state.sent_blocks, len(seq.block_table)
        wants_lp = (p.prompt_logprobs and seq.encoder_ids is None
                    and start < len(seq.prompt_ids) and len(state.prefill) < len(seq.prompt_ids))
        # A chunk reports log p of its tokens after the first; the first's comes from the
        # previous chunk's last position, which only a sampling step computes. A later chunk
        # of a prompt being scored so starts one token early (that token's K/V is written
        # again, with the same values).
        back = 1 if wants_lp and start > 0 else 0
        known = s.num_new - s.num_draft
        tokens = _tokens(seq, start - back, known + back)
        if s.num_draft:
            tokens += seq.draft[: s.num_draft]
        step = SeqStep(
            seq_id=seq.seq_id, token_ids=tokens, num_draft=s.num_draft,
            start_pos=start - back, block_table=seq.block_table[blocks_from:],
            blocks_from=blocks_from, sample=s.completes_prompt,
            params=p, history=seq.all_ids if p.needs_history else None,
            num_generated=len(seq.output_ids), prompt_logprobs=wants_lp,
            long_rope=seq.long_rope, adapter=seq.adapter)
        if state.matcher is not None and step.sample:
            # The mask needs every earlier token: steps with guided rows are collected
            # before the next one is scheduled (_launch), so none is pending here.
            if state.unresolved:
                raise RuntimeError(f"guided sequence {seq.seq_id} scheduled with a token "
                                   "still on the device")
            step.allowed = state.matcher.mask()
        if state.unresolved and PENDING_TOKEN in step.token_ids:
            # Sampled by the step still on the device (at most one token: step n+1 is
            # scheduled after step n-1 was collected).
            step.prev_at = step.token_ids.index(PENDING_TOKEN)
        if seq.encoder_ids is not None:
            step.encoder_len = len(seq.encoder_ids)
            step.cross_block_table = list(seq.cross_block_table)
            if start == 0:  # first step, or recompute after a preemption
                step.encoder_ids = seq.encoder_ids
        return step

    def step(self, return_logits: bool = False) -> tuple[list[TokenOutput], StepOutput | None]:
        """Run one step. Returns a TokenOutput for every token collected, and the raw output
        of the last step collected.

        Overlapped (the default): launch step n+1, then collect step n, so the host's work
        (scheduling, building step n+1, processing step n's tokens) runs while the device
        computes. Step n+1 is scheduled before step n's tokens are known: each sequence's
        token from step n stands as PENDING_TOKEN and the workers fill it in on the device;
        a sequence that step n ends (EOS) computed one more token in step n+1, which is
        dropped, and length limits are known in advance (Sequence.hold). So outputs are the
        same as one step at a time. A step whose sampling needs the host-side token history
        (repetition or frequency penalties), or a grammar's mask (guided requests: the next
        mask depends on this token), or that returns logits, is collected at once."""
        t0 = time.perf_counter()
        outputs: list[TokenOutput] = []
        raw = None
        prev, self._inflight = self._inflight, None
        if prev is not None and (prev.sync or return_logits or not self.overlap):
            outputs, raw = self._collect(prev)
            prev = None
        if self.spec is not None:
            self._draft()
        scheduled = self.scheduler.schedule()
        cur = self._launch(scheduled, return_logits) if scheduled else None
        if prev is not None:
            got, raw = self._collect(prev)
            outputs += got
        if cur is not None:
            if cur.sync or return_logits or not self.overlap:
                got, raw = self._collect(cur)
                outputs += got
            else:
                self._inflight = cur
        self.busy_seconds += time.perf_counter() - t0
        return outputs, raw

    def _draft(self) -> None:
        """Propose drafts for the running sequences that speculate. A step after which one
        looks up again is collected at once (_launch), so its tokens are all known here.
        A batch of more than spec.max_batch sequences drafts nothing: it decodes plainly."""
        busy = len(self.scheduler.running) > self.spec.max_batch
        for seq in self.scheduler.running:
            seq.draft = []
            if busy:
                continue
            if not speculates(seq.params):
                continue
            state = self.requests[seq.seq_id]
            if state.spec_skip:  # missed lately: decode plainly (and overlapped) a while
                state.spec_skip -= 1
                continue
            if seq.num_pending != 1 or seq.hold or state.unresolved:
                continue
            budget = draft_budget(seq, self.spec.num_tokens, self.max_model_len,
                                  self.longrope_original)
            seq.draft = draft(seq, self.spec, budget, state.spec_tokens)
            if not seq.draft and budget > 0:
                self._missed(state)

    def _missed(self, state: CoreRequest) -> None:
        state.spec_misses += 1
        state.spec_skip = skip_after(state.spec_misses)

    def _launch(self, scheduled: list[ScheduledSeq], return_logits: bool) -> _Launched:
        steps = [self._seq_step(s) for s in scheduled]
        batch = StepBatch(next(self._steps), steps, return_logits, released=self._released)
        self._released = []
        handle = self.executor.launch_step(batch)
        # Where each scored chunk's log-probabilities start: token_ids[1:] of the chunk.
        scored = {st.seq_id: st.start_pos + 1 for st in steps if st.prompt_logprobs}
        self.steps_run += 1
        self.step_tokens += sum(s.num_new for s in scheduled)
        if any(not st.sample or len(st.token_ids) - st.num_draft > 1 for st in steps):
            self.prefill_steps += 1
        self.scheduler.after_step(scheduled)
        sync = False
        drafts: dict[int, list[int]] = {}
        # A batch too big to draft next step need not wait for this one (_draft).
        lookup_next = self.spec is not None and len(self.scheduler.running) <= self.spec.max_batch
        for s, st in zip(scheduled, steps, strict=True):
            if not st.sample:
                continue
            seq, p = s.seq, s.seq.params
            sync = sync or st.history is not None or st.allowed is not None
            if self.spec is not None and speculates(p):
                # A lookup next step needs this step's tokens: collect it first.
                sync = sync or st.num_draft > 0 or (
                    lookup_next and not self.requests[seq.seq_id].spec_skip)
                if st.num_draft:
                    drafts[seq.seq_id] = st.token_ids[-st.num_draft :]
                    self.spec_draft_tokens += st.num_draft
                    continue  # its 1..num_draft + 1 tokens are appended on collect
            seq.output_ids.append(PENDING_TOKEN)
            seq.output_logprobs.append(0.0)
            self.requests[seq.seq_id].unresolved += 1
            n = len(seq.output_ids)
            if n >= p.max_new_tokens or seq.num_input_tokens + n >= self.max_model_len:
                seq.hold = True  # this token is its last: schedule it no more
        return _Launched(handle, sync, scored, drafts)

    def _collect(self, launched: _Launched) -> tuple[list[TokenOutput], StepOutput]:
        t0 = time.perf_counter()
        out = self.executor.collect(launched.handle)
        self.device_wait_seconds += time.perf_counter() - t0
        for seq_id, lps in out.prompt_logprobs.items():
            self._record_prefill(seq_id, lps, out.prompt_top.get(seq_id),
                                 launched.scored.get(seq_id, 1))
        outputs = []
        tokens, i = out.tokens, 0
        while i < len(tokens):
            tok = tokens[i]
            drafts = launched.drafts.get(tok.seq_id)
            state = self.requests.get(tok.seq_id)
            if drafts is not None:
                group, i = tokens[i : i + len(drafts) + 1], i + len(drafts) + 1
                if state is not None:
                    outputs += self._verify(state, drafts, group)
                continue
            i += 1
            if state is not None:  # else finished or aborted meanwhile: the token is dropped
                outputs.append(self._append(state, tok))
        return outputs, out

    def _verify(self, state: CoreRequest, drafts: list[int], group: list) -> list[TokenOutput]:
        """Output the target's tokens of a drafted row up to its first disagreement with the
        drafts; the cache keeps the accepted drafts' keys and values, and the blocks grown
        for the rest go back (the rejected drafts' entries in them are never read)."""
        n = accepted(drafts, [t.token_id for t in group])
        self.spec_accepted_tokens += n
        if n:
            state.spec_misses = 0
        else:
            self._missed(state)
        seq, outputs = state.seq, []
        for tok in group[: n + 1]:
            seq.output_ids.append(PENDING_TOKEN)
            seq.output_logprobs.append(0.0)
            state.unresolved += 1
            out = self._append(state, tok)
            outputs.append(out)
            if out.finish_reason is not None:
                return outputs  # EOS or length inside the run: the rest never leaves
        seq.num_computed += n
        self.scheduler.blocks.after_compute(seq)
        self.scheduler.blocks.shrink(seq)
        state.sent_blocks = min(state.sent_blocks, len(seq.block_table))
        return outputs

    def _record_prefill(self, seq_id: int, lps: list[float],
                        tops: list[list[tuple[int, float]]] | None, first: int) -> None:
        """Log-probabilities of prompt positions first, first + 1, ...: those that extend
        the prefill (a chunk recomputed after a preemption repeats known ones)."""
        state = self.requests.get(seq_id)
        if state is None:
            return
        ids, prefill = state.seq.prompt_ids, state.prefill
        for i, lp in enumerate(lps):
            pos = first + i
            if pos == len(prefill) and pos < len(ids):
                prefill.append((ids[pos], lp, tops[i] if tops else []))

    def _append(self, state: CoreRequest, tok) -> TokenOutput:
        """Put a collected token in its place: the oldest of the sequence's pending ones."""
        seq, p = state.seq, state.seq.params
        at = len(seq.output_ids) - state.unresolved
        seq.output_ids[at] = tok.token_id
        seq.output_logprobs[at] = tok.logprob
        state.unresolved -= 1
        count = at + 1
        out = TokenOutput(tok.seq_id, tok.token_id, tok.logprob, tok.top, count,
                          seq.num_input_tokens)
        if p.prompt_logprobs and not state.prefill_sent:
            # Every prompt log-probability is known once the first token is sampled.
            out.prefill, state.prefill_sent = state.prefill, True
        reason = None
        if state.matcher is not None and not self._guide(state, tok.token_id):
            reason = "eos_token"  # the grammar is complete and no EOS can end it
        elif tok.token_id in self.eos_ids and not p.ignore_eos:
            reason = "eos_token"
        elif count >= p.max_new_tokens or seq.num_input_tokens + count >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(seq.seq_id, reason)  # a token after this one, in flight, is dropped
            out.finish_reason = reason
        return out

    def _guide(self, state: CoreRequest, token_id: int) -> bool:
        """Advance a guided request's grammar past its token; False when the request must
        end here: the grammar is complete and an end-of-sequence token cannot end it (no EOS
        id, or ignore_eos), or it did not allow the token (only a row whose logits were
        all NaN samples outside the mask)."""
        matcher = state.matcher
        if not matcher.accept(token_id):
            log.warning("guided sequence %d: the grammar did not allow token %d (%s); "
                        "ending it", state.seq.seq_id, token_id, matcher.error)
            return False
        # Complete: the mask now allows only EOS, which ends it as any request ends.
        return not (matcher.stopped and (state.seq.params.ignore_eos or not self.eos_ids))

    def finish(self, seq_id: int, reason: str) -> None:
        """End a sequence for `reason` (the output processor's stop strings come here too)."""
        state = self.requests.pop(seq_id, None)
        if state is not None:
            _drop_pending(state)
            self.scheduler.finish(state.seq)
            state.seq.finish_reason = reason
            self._released.append(seq_id)

    def shutdown(self) -> None:
        self.executor.shutdown()


def eos_token_ids(path: str, hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(x for x in v if isinstance(x, int))

    gen = Path(path) / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    return ids


def _drop_pending(state: CoreRequest) -> None:
    """An ended sequence keeps only the tokens collected so far: those still on the device
    (computed by a step launched before it ended) are never output."""
    if state.unresolved:
        del state.seq.output_ids[-state.unresolved:], state.seq.output_logprobs[-state.unresolved:]
        state.unresolved = 0


def work_tokens(seqs) -> int:
    """Tokens still to compute for these sequences (prompt rest plus tokens they may still
    generate): what a replica router weighs replicas by."""
    total = 0
    for q in seqs:
        left = q.params.max_new_tokens - len(q.output_ids)
        total += q.num_pending + (left if left > 0 else 0)
    return total


def _tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.all_ids[start:start + n] without building all_ids (O(n), not O(context))."""
    p = len(seq.prompt_ids)
    if start >= p:
        return seq.output_ids[start - p : start - p + n]
    if start + n <= p:
        return seq.prompt_ids[start : start + n]
    return seq.prompt_ids[start:] + seq.output_ids[: start + n - p]
