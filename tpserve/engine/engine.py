"""The engine as one object in one process: the engine core (scheduling, EOS and length)
plus the output processor (text, stop strings). Tests, benchmarks and the driver's serving
loop use it; the executor is built by whoever launches it (tpserve/cluster/driver.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpserve.config import EngineConfig
from tpserve.engine.core import EngineCore, decoder_start_token_id, eos_token_ids
from tpserve.engine.guided import DriverGrammars
from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.request import GenerationEvent, GuidedSpec, SamplingParams
from tpserve.engine.sequence import Sequence
from tpserve.engine.step import StepOutput
from tpserve.errors import CheckpointError, ValidationError

if TYPE_CHECKING:  # the engine sees the interface only; the launcher builds the executor
    from tpserve.executor.base import Executor

__all__ = ["Engine", "decoder_start_token_id", "eos_token_ids", "token_spans"]


def tokenize(tokenizer, prompt: str | list[int], truncate: int | None = None,
             add_special_tokens: bool = True, vocab_size: int | None = None) -> list[int]:
    """The prompt's token ids; with `truncate`, only its last `truncate` (TGI's rule). A
    prompt given as token ids (OpenAI's token-id prompts) is taken as it is, with nothing
    added, after checking each id against the model's vocabulary (`vocab_size`, else the
    tokenizer's): an id past the embedding would fail the whole step on the device."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
    else:
        ids = list(prompt)
        limit = vocab_size or len(tokenizer)
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} in the prompt is not in the model's "
                                  f"vocabulary (0 to {limit - 1})")
    if truncate is not None and len(ids) > truncate:
        ids = ids[-truncate:]
    return ids


def token_spans(tokenizer, text: str, add_special_tokens: bool = True
                ) -> list[tuple[int, int, int]]:
    """`text` as the prompt's tokens: (id, start, stop), the characters of `text` each one
    covers (an added special token such as BOS covers none: start == stop). Slow tokenizers
    have no offsets: their pieces are laid end to end as decoded, which is exact whenever
    decoding gives the text back."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens,
                        return_offsets_mapping=True)
        return [(i, a, b) for i, (a, b) in zip(enc.input_ids, enc.offset_mapping, strict=True)]
    except NotImplementedError:  # a Python (slow) tokenizer
        ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        special = set(tokenizer.all_special_ids)
        out, at = [], 0
        for i in ids:
            n = 0 if i in special else len(tokenizer.decode([i]))
            out.append((i, min(at, len(text)), min(at + n, len(text))))
            at += n
        return out


def vocab_id(tokenizer, piece: str) -> int | None:
    """The id of `piece` when it is one token of the vocabulary (added and special tokens
    included), else None. Looked up by name, not by encoding the text: some tokenizers never
    encode control tokens from text."""
    tid = tokenizer.convert_tokens_to_ids(piece)
    if tid is None or (tid == tokenizer.unk_token_id and piece != tokenizer.unk_token):
        return None
    return tid


class Engine(EngineCore):
    def __init__(self, cfg: EngineConfig, executor: Executor, hf_config=None) -> None:
        try:
            from tpserve.tokenizer import load_tokenizer
            from tpserve.weights import load_hf_config

            hf_config = hf_config or load_hf_config(cfg.model.path)
            try:
                self.tokenizer = load_tokenizer(cfg.model.tokenizer_path, cfg.model.path)
            except Exception as exc:  # noqa: BLE001 - say which file is missing
                raise CheckpointError(f"cannot load a tokenizer from {cfg.model.tokenizer_path}: "
                                      f"{exc}") from exc
        except BaseException:
            executor.shutdown()  # no shard actors or placement groups left behind
            raise
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        super().__init__(cfg, executor, hf_config,
                         eos_token_ids(cfg.model.path, hf_config, self.tokenizer))
        self.output = OutputProcessor(self.tokenizer, self.special_ids)
        # Core and driver in one process: one set of compiled grammars for both.
        self.driver_grammars = DriverGrammars(
            self.tokenizer, getattr(self.hf_config, "vocab_size", None), self.eos_ids)

    def check_grammar(self, spec: GuidedSpec) -> None:
        """Compile a guided request's grammar (the driver calls this off its event loop);
        ValidationError when it does not compile."""
        self._use_driver_grammars()
        self.grammars.check(spec)

    def _use_driver_grammars(self) -> None:
        grammars = self.driver_grammars.get()
        if self.grammars is not grammars:
            self.grammars = grammars

    def tokenize(self, prompt: str | list[int], truncate: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        return tokenize(self.tokenizer, prompt, truncate, add_special_tokens,
                        getattr(self.hf_config, "vocab_size", None))

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if params.guided is not None:
            self._use_driver_grammars()
        seq = super().add_request(prompt_ids, params)
        self.output.add(seq.seq_id, seq.params)  # with the seed the core filled in
        return seq

    def abort(self, seq_id: int) -> None:
        super().abort(seq_id)
        self.output.remove(seq_id)

    def step(self, return_logits: bool = False) -> tuple[list[tuple[int, GenerationEvent]],
                                                         StepOutput | None]:
        """Run one step. Returns (seq_id, event) for every token produced, and the raw output."""
        outputs, raw = super().step(return_logits)
        events, stopped = self.output.process(outputs)
        for seq_id in stopped:
            self.finish(seq_id, "stop_sequence")
        return events, raw

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
