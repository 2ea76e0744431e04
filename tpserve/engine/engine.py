"""The engine: admission, scheduling, one step through the Executor, then stop conditions
and incremental text. Synchronous and torch-free; the async bridge is async_engine.py. The
executor is built by whoever launches the engine (tpserve/cluster/driver.py, tests)."""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tpserve.config import EngineConfig
from tpserve.engine.block_manager import BlockManager
from tpserve.engine.detokenizer import IncrementalDetokenizer
from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo
from tpserve.engine.scheduler import ScheduledSeq, Scheduler
from tpserve.engine.sequence import Sequence
from tpserve.engine.step import SeqStep, StepBatch, StepOutput
from tpserve.errors import CheckpointError, ValidationError

if TYPE_CHECKING:  # the engine sees the interface only; the launcher builds the executor
    from tpserve.executor.base import Executor

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer
    prefill: list[TokenInfo] = field(default_factory=list)
    first_token_at: float | None = None


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


class Engine:
    def __init__(self, cfg: EngineConfig, executor: Executor, hf_config=None) -> None:
        self.cfg = cfg
        self.executor = executor
        try:
            self._setup(cfg, hf_config)
        except BaseException:
            executor.shutdown()  # no shard actors or placement groups left behind
            raise
        self.requests: dict[int, RequestState] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()

    def _setup(self, cfg: EngineConfig, hf_config) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.hf_config = hf_config or AutoConfig.from_pretrained(cfg.model.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        except Exception as exc:  # noqa: BLE001 - say which file is missing, not a traceback
            raise CheckpointError(f"cannot load a tokenizer from {cfg.model.path}: {exc}") from exc
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.eos_ids = eos_token_ids(cfg.model.path, self.hf_config, self.tokenizer)
        self.max_model_len = cfg.model.max_model_len
        # Encoder-decoder: the prompt feeds the encoder; the decoder starts from one token.
        self.encoder_decoder = bool(getattr(self.hf_config, "is_encoder_decoder", False))
        self.decoder_start = (decoder_start_token_id(cfg.model.path, self.hf_config)
                              if self.encoder_decoder else None)
        self.max_input_tokens = cfg.scheduler.max_input_tokens or self.max_model_len - 1
        self._start_executor(cfg)
        window = getattr(self.hf_config, "sliding_window", None) if self._windowed() else None
        self.scheduler = Scheduler(self._block_manager(window),
                                   cfg.scheduler.max_num_seqs,
                                   cfg.scheduler.max_num_batched_tokens, window)

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
        log.info("KV cache: %d blocks x %d tokens per shard", num_blocks, cfg.cache.block_size)

    def _block_manager(self, window: int | None) -> BlockManager:
        if not self.cfg.cache.prefix_caching:
            return BlockManager(self.num_blocks, self.cfg.cache.block_size)
        if self.encoder_decoder or window or getattr(self.hf_config, "sliding_window", None):
            log.warning("--prefix-caching is off for this model: it covers decoder-only "
                        "models without a sliding window")
            return BlockManager(self.num_blocks, self.cfg.cache.block_size)
        log.info("prefix caching on: full KV blocks are shared across requests")
        return PrefixCachingBlockManager(self.num_blocks, self.cfg.cache.block_size)

    def _windowed(self) -> bool:
        """Blocks can leave the cache only when every layer uses the same window."""
        w = getattr(self.hf_config, "sliding_window", None)
        layer_types = getattr(self.hf_config, "layer_types", None)
        if layer_types and any(t != "sliding_attention" for t in layer_types):
            return False
        return bool(w) and getattr(self.hf_config, "use_sliding_window", True) is not False

    # --- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str, truncate: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValidationError("`inputs` tokenizes to zero tokens; send a non-empty prompt")
        if n > self.max_input_tokens:
            raise ValidationError(f"`inputs` must have at most {self.max_input_tokens} tokens. "
                                  f"Given: {n}. Shorten the prompt or set `truncate`.")
        if n + params.max_new_tokens > self.max_model_len:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.max_model_len}. Given: {n} "
                f"`inputs` tokens and {params.max_new_tokens} `max_new_tokens`")
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
        state = RequestState(seq, IncrementalDetokenizer(self.tokenizer, self.special_ids))
        if self.encoder_decoder and params.prompt_logprobs:
            # The decoder's input is only the start token, which has no log-probability.
            state.prefill.append(self._token_info(self.decoder_start, None))
        self.requests[seq.seq_id] = state
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: int) -> None:
        state = self.requests.pop(seq_id, None)
        if state is not None:
            self.scheduler.finish(state.seq)

    def has_work(self) -> bool:
        return len(self.scheduler) > 0

    # --- one step -----------------------------------------------------------------------
    def _seq_step(self, s: ScheduledSeq) -> SeqStep:
        seq, p = s.seq, s.seq.params
        start = seq.num_computed
        need_history = bool(p.repetition_penalty and p.repetition_penalty != 1.0) \
            or bool(p.frequency_penalty)
        step = SeqStep(
            seq_id=seq.seq_id, token_ids=seq.all_ids[start : start + s.num_new],
            start_pos=start, block_table=list(seq.block_table), sample=s.completes_prompt,
            params=p, history=seq.all_ids if need_history else None,
            num_generated=len(seq.output_ids),
            prompt_logprobs=p.prompt_logprobs and start < len(seq.prompt_ids))
        if seq.encoder_ids is not None:
            step.prompt_logprobs = False
            step.encoder_len = len(seq.encoder_ids)
            step.cross_block_table = list(seq.cross_block_table)
            if start == 0:  # first step, or recompute after a preemption
                step.encoder_ids = seq.encoder_ids
        return step

    def step(self, return_logits: bool = False) -> tuple[list[tuple[int, GenerationEvent]],
                                                         StepOutput | None]:
        """Run one step. Returns (seq_id, event) for every token produced, and the raw output."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return [], None
        batch = StepBatch(next(self._steps), [self._seq_step(s) for s in scheduled],
                          return_logits)
        out = self.executor.execute_step(batch)
        self.scheduler.after_step(scheduled)
        for seq_id, lps in out.prompt_logprobs.items():
            self._record_prefill(seq_id, lps)
        events = []
        for tok in out.tokens:
            state = self.requests.get(tok.seq_id)
            if state is not None:
                events.append((tok.seq_id, self._append(state, tok)))
        return events, out

    def _record_prefill(self, seq_id: int, lps: list[float]) -> None:
        state = self.requests.get(seq_id)
        if state is None:
            return
        ids = state.seq.prompt_ids
        if not state.prefill:
            state.prefill.append(self._token_info(ids[0], None))
        start = len(state.prefill)
        for i, lp in enumerate(lps):
            if start + i < len(ids):
                state.prefill.append(self._token_info(ids[start + i], lp))

    def _token_info(self, tid: int, logprob: float | None, text: str | None = None) -> TokenInfo:
        special = tid in self.special_ids
        if text is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
        return TokenInfo(tid, text, logprob, special)

    def _append(self, state: RequestState, tok) -> GenerationEvent:
        seq, p = state.seq, state.seq.params
        seq.output_ids.append(tok.token_id)
        seq.output_logprobs.append(tok.logprob)
        special = tok.token_id in self.special_ids
        text = state.detok.add(tok.token_id)
        if special:
            text = self.tokenizer.decode([tok.token_id], skip_special_tokens=False)
        info = TokenInfo(tok.token_id, text, tok.logprob, special)
        top = [self._token_info(t, lp) for t, lp in tok.top] if p.top_n_tokens else None
        reason = None
        if tok.token_id in self.eos_ids and not p.ignore_eos:
            reason = "eos_token"
        elif p.stop and any(s in state.detok.text[-(len(s) + len(text) + 8):] for s in p.stop):
            reason = "stop_sequence"
        elif len(seq.output_ids) >= p.max_new_tokens \
                or seq.num_input_tokens + len(seq.output_ids) >= self.max_model_len:
            reason = "length"
        event = GenerationEvent(token=info, top_tokens=top, generated_tokens=len(seq.output_ids),
                                prompt_tokens=seq.num_input_tokens)
        if reason is not None:
            final_text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            if not special and final_text.startswith(state.detok.text):
                # Text held back for an incomplete character goes out with the last token,
                # so the streamed pieces add up to generated_text.
                info = replace(info, text=info.text + final_text[len(state.detok.text):])
                event.token = info
            self.scheduler.finish(seq)
            self.requests.pop(seq.seq_id, None)
            seq.finish_reason = reason
            event.finished = True
            event.finish_reason = reason
            event.generated_text = final_text
            event.seed = None if p.greedy else p.seed
            event.prefill = state.prefill
        return event

    # --- offline use (tests, benchmarks) ------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams
                 ) -> list[GenerationEvent]:
        """Run prompts to completion together; the final event of each, in order."""
        seqs = [self.add_request(p if isinstance(p, list) else self.tokenize(p), params)
                for p in prompts]
        final: dict[int, GenerationEvent] = {}
        while len(final) < len(seqs):
            events, _ = self.step()
            for sid, ev in events:
                if ev.finished:
                    final[sid] = ev
        return [final[s.seq_id] for s in seqs]

    def shutdown(self) -> None:
        self.executor.shutdown()
