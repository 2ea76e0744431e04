"""Guided decoding (structured output) over llguidance: the vocabulary it needs, compiled
grammars cached by (kind, value), and one matcher per guided request.

llguidance (Rust, numpy-only Python bindings; no torch) compiles a JSON schema or a regular
expression against the tokenizer and, for a matcher's current state, gives the next token's
allowed set as a bitmask of int32 words (bit i of word w: token 32 * w + i). The engine core
keeps a matcher per guided request where sampled tokens arrive, ships each step's mask to the
sampling rank with the step, and feeds the sampled token back (tpserve/engine/core.py).

End-of-sequence tokens are allowed only where the grammar accepts; once it is complete the
mask allows them alone, so a guided request ends with an EOS token as any other does.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from tpserve.engine.request import GuidedSpec
from tpserve.errors import ValidationError

# Whitespace between two tokens of JSON: one space, or a line break and up to 32 spaces or
# tabs of indentation. llguidance's default allows any amount, and a model can emit
# whitespace until max_tokens runs out (small ones do): this still admits compact JSON,
# Python's ", " and ": ", and pretty-printed JSON nested a few levels deep. A schema's own
# "x-guidance" options are merged over it; those that set the whitespace themselves
# (WHITESPACE_OPTIONS, e.g. {"whitespace_flexible": false}: none at all) replace it.
JSON_DEFAULTS = {"whitespace_pattern": r"(?:[ ]|\r?\n[ \t]{0,32})?"}
WHITESPACE_OPTIONS = frozenset({"whitespace_flexible", "whitespace_pattern"})
# Compiled grammars kept per process (each holds its lexer and parser tables).
CACHE_SIZE = 64


def _library():
    try:
        import llguidance
    except ImportError as exc:  # a dependency of tpserve; missing only in a trimmed install
        raise ValidationError("structured output (`grammar`, `response_format`) needs the "
                              "llguidance package on the server: pip install llguidance "
                              f"({exc})") from exc
    return llguidance


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar of a spec (cheap: the library compiles it in LLMatcher)."""
    ll = _library()
    if spec.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(spec.value)
    schema = json.loads(spec.value)
    if schema is True:  # any JSON value; llguidance takes options only on an object
        schema = {}
    return ll.LLMatcher.grammar_from_json_schema(schema, defaults=_json_defaults(schema))


def _json_defaults(schema) -> dict | None:
    """JSON_DEFAULTS, unless the schema's own options set the whitespace (or are not an
    object, or the schema is `false`: the library's error names them)."""
    if not isinstance(schema, dict):
        return None
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict) or own.keys() & WHITESPACE_OPTIONS:
        return None
    return JSON_DEFAULTS


@dataclass
class GuidedVocab:
    """What llguidance needs of the tokenizer: its serialized fast tokenizer, the width of
    the model's logits (masks cover every id the sampler can pick) and the EOS ids. Plain
    data, so the driver can send it to the engine core's process; the library's tokenizer
    is built on first use there (about a second for a 128k vocabulary, once per process)."""

    tokenizer_json: str
    n_vocab: int
    eos_ids: list[int]
    _built: object = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def from_tokenizer(cls, tokenizer, model_vocab: int | None,
                       eos_ids) -> GuidedVocab | None:
        """From a transformers fast tokenizer; None for one without a Rust backend (slow
        tokenizers), whose guided requests are refused."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        n = max(model_vocab or 0, len(tokenizer))
        # llguidance takes EOS ids only inside the tokenizer's own vocabulary; an id past it
        # (a config naming a token its tokenizer lacks) would fail every grammar, so such a
        # token just stays forbidden in guided rows.
        return cls(backend.to_str(), n,
                   sorted(t for t in eos_ids if 0 <= t < min(n, len(tokenizer))))

    def __getstate__(self) -> dict:  # the library's objects stay in their process
        return {"tokenizer_json": self.tokenizer_json, "n_vocab": self.n_vocab,
                "eos_ids": self.eos_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def lltokenizer(self):
        with self._lock:
            if self._built is None:
                ll = _library()
                try:
                    self._built = ll.LLTokenizer(self.tokenizer_json, n_vocab=self.n_vocab,
                                                 eos_token=self.eos_ids or None)
                except TypeError:
                    # llguidance before lists of EOS ids (1.6 takes one int; found on a
                    # GPU machine's preinstalled copy): the first EOS id ends a grammar,
                    # the others stay forbidden in guided rows.
                    self._built = ll.LLTokenizer(
                        self.tokenizer_json, n_vocab=self.n_vocab,
                        eos_token=self.eos_ids[0] if self.eos_ids else None)
            return self._built

    @property
    def words(self) -> int:
        """int32 words per mask."""
        return (self.n_vocab + 31) // 32


class GuidedMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, words: int) -> None:
        self._m, self.words = matcher, words

    def mask(self) -> np.ndarray:
        """The tokens allowed next: int32 words, bit i of word w = token 32 * w + i."""
        out = np.empty(self.words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (a row the
        sampler had to fall back on, NaN logits): the matcher is then in its error state."""
        return self._m.consume_token(token_id)

    @property
    def stopped(self) -> bool:
        """Complete: nothing but an end-of-sequence token may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class Grammars:
    """Compiled grammars by (kind, value), least recently used dropped past CACHE_SIZE.
    Thread-safe: the driver checks requests on worker threads while the engine loop makes
    matchers (in one process when the engine runs in-process)."""

    def __init__(self, vocab: GuidedVocab | None) -> None:
        self.vocab = vocab
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._errors: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def _compiled(self, spec: GuidedSpec):
        """A pristine matcher of the spec's grammar (new matchers are copies of it), or
        ValidationError naming the request's field and llguidance's reason."""
        if self.vocab is None:
            raise ValidationError(f"`{spec.where}`: structured output needs a fast (Rust) "
                                  "tokenizer, and this model's has none")
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            error = self._errors.get(key)
        if error is None:
            ll = _library()
            try:
                matcher = ll.LLMatcher(self.vocab.lltokenizer(), grammar_text(spec),
                                       log_level=0)
                error = matcher.get_error() if matcher.is_error() else None
            except (ValueError, RuntimeError) as exc:  # malformed input to the library
                error = str(exc)
        with self._lock:
            if error is not None:
                self._errors[key] = error
                while len(self._errors) > CACHE_SIZE:
                    self._errors.popitem(last=False)
            else:
                self._cache[key] = matcher
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if error is not None:
            what = "regular expression" if spec.kind == "regex" else "JSON schema"
            raise ValidationError(f"`{spec.where}`: the {what} does not compile: "
                                  f"{error.strip()}")
        return matcher

    def check(self, spec: GuidedSpec) -> None:
        """Compile (or find) the spec's grammar; ValidationError when it does not compile."""
        self._compiled(spec)

    def matcher(self, spec: GuidedSpec) -> GuidedMatcher:
        return GuidedMatcher(self._compiled(spec).deep_copy(), self.vocab.words)


class DriverGrammars:
    """The driver's grammars: built from its tokenizer on the first guided request (the
    tokenizer's serialization and the library's tables cost nothing to requests without a
    grammar), then shared by every check."""

    def __init__(self, tokenizer, model_vocab: int | None, eos_ids) -> None:
        self._args = (tokenizer, model_vocab, eos_ids)
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    def get(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(GuidedVocab.from_tokenizer(*self._args))
            return self._grammars

    def check(self, spec: GuidedSpec) -> None:
        self.get().check(spec)
