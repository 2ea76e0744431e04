"""Which reasoning format a server reads (`--reasoning-parser`), decided once per app
against the model's vocabulary, when a chat or Responses request first needs it (the
tokenizer is loaded after the app is built, while the shards start).

A named format is read as it is. `auto` reads the first format of reasoning.FORMATS whose
two tags are each one token of the vocabulary (harmony's tags: each of the tokens they are
written with) (Qwen3's and DeepSeek-R1's `<think>` are
added tokens, Magistral's `[THINK]` control tokens; a model that never learnt a format
spells its tags with several tokens), and falls back to none, saying so in an info line.

Tags that are tokens go to the engine as SamplingParams.keep_special_ids: where they are
special tokens (Magistral's), decoding would leave them out of the text and the splitter
could not see where the reasoning ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tpserve.server.backend import EngineBackend
from tpserve.server.reasoning import FORMATS, PARSERS, Tags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningFormat:
    tags: Tags
    keep_ids: tuple[int, ...]  # the tags' token ids, where they are tokens


class ReasoningParser:
    """The flag's format for one app, resolved on first use; shared by its chat and
    Responses routes."""

    def __init__(self, parser: str, backend: EngineBackend) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: one of {PARSERS}")
        self.parser = parser
        self.backend = backend
        self._resolved = False
        self._format: ReasoningFormat | None = None

    def format(self) -> ReasoningFormat | None:
        """The format answers are split by; None: they are not split. Call once the
        backend is ready (it reads the tokenizer)."""
        if not self._resolved:
            self._format, self._resolved = self._resolve(), True
        return self._format

    def _ids(self, tags: Tags) -> list[int | None]:
        lookup = getattr(self.backend, "token_id", None)
        return [lookup(t) if lookup else None for t in tags.token_names()]

    def _resolve(self) -> ReasoningFormat | None:
        if self.parser == "none":
            return None
        if self.parser != "auto":
            tags = FORMATS[self.parser]
            return ReasoningFormat(tags, tuple(i for i in self._ids(tags) if i is not None))
        for name, tags in FORMATS.items():
            ids = self._ids(tags)
            if None not in ids:
                log.info("--reasoning-parser auto: reading %s (%s ... %s are tokens of the "
                         "model's vocabulary)", name, tags.open, tags.close)
                return ReasoningFormat(tags, tuple(ids))
        spelled = ", ".join(f"{t.open} {t.close}" for t in FORMATS.values())
        log.info("--reasoning-parser auto: none (no format's tags are tokens of the model's "
                 "vocabulary: %s); chat and Responses answers are not split", spelled)
        return None
