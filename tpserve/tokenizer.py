"""The checkpoint's tokenizer (or the one --tokenizer names), with its chat template wherever
the checkpoint keeps it.

Vision-language repositories often keep the chat template beside the tokenizer rather than
in tokenizer_config.json: in chat_template.jinja (which transformers' tokenizer reads) or in
a processor's chat_template.json ({"chat_template": "..."}, which only transformers'
processor reads). The chat routes need it either way, so a tokenizer without a template
takes the one of those files."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tpserve.errors import CheckpointError
from tpserve.tokenizer_files import TOKENIZER_FILES, has_tokenizer

log = logging.getLogger(__name__)


def resolve_tokenizer(name: str, revision: str | None = None,
                      download_timeout: float | None = None) -> Path:
    """--tokenizer: a local directory holding tokenizer files, or a hub id whose tokenizer
    files (only those) come from the hub cache or are downloaded into it (tpserve/hub.py)."""
    local = Path(name).expanduser()
    if local.is_dir():
        if not has_tokenizer(local):
            raise CheckpointError(
                f"--tokenizer {name}: {local.resolve()} has no tokenizer files (none of "
                f"{', '.join(TOKENIZER_FILES)}): pass the directory a tokenizer was saved to "
                "(`AutoTokenizer.from_pretrained(ID).save_pretrained(DIR)`) or a hub id")
        if revision:
            log.warning("--tokenizer-revision %s is ignored: %s is a local directory",
                        revision, local.resolve())
        return local.resolve()
    from tpserve import hub

    if not hub.is_hub_id(name):
        raise CheckpointError(f"--tokenizer {name!r} not found: {local.resolve()} does not "
                              "exist (a path; a hub id looks like org/name)")
    return hub.ensure_model(name, revision, weights=False, timeout=download_timeout,
                            tokenizer_only=True)


def load_tokenizer(path: str | Path, model_path: str | Path | None = None):
    """The tokenizer of `path`. Without a chat template of its own, it takes the one beside
    it, else (a tokenizer given with --tokenizer) the one beside the model at `model_path`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        missing = sentencepiece_missing(Path(path))
        if missing:
            raise CheckpointError(missing) from exc
        raise
    if not getattr(tokenizer, "chat_template", None):
        places = [Path(path)] + ([Path(model_path)] if model_path is not None else [])
        template = next(filter(None, map(chat_template_beside, places)), None)
        if template:
            tokenizer.chat_template = template
    return tokenizer


# SentencePiece model files (Llama and Mistral, T5, XLM-R and mBART) that transformers can
# read only through the sentencepiece package when no tokenizer.json is beside them.
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def sentencepiece_missing(path: Path) -> str | None:
    """What to do when `path` keeps its tokenizer only as a SentencePiece model and the
    sentencepiece package is not installed (transformers then reports a missing `tiktoken`,
    a format the file is not in); None otherwise."""
    import importlib.util

    if (path / "tokenizer.json").is_file() or importlib.util.find_spec("sentencepiece"):
        return None
    model = next((name for name in SENTENCEPIECE_FILES if (path / name).is_file()), None)
    if model is None:
        return None
    return (f"the tokenizer in {path} is a SentencePiece model ({model}) without a "
            "tokenizer.json, and reading it needs the sentencepiece package, which is not "
            "installed: `pip install sentencepiece`, or pass --tokenizer a directory where "
            "the tokenizer was saved with its tokenizer.json "
            "(`AutoTokenizer.from_pretrained(ID).save_pretrained(DIR)` where sentencepiece "
            "is installed)")


def check_vocab(tokenizer, hf_config, tokenizer_name: str, model_name: str) -> None:
    """Refuse a tokenizer whose ids run past the model's embedding rows: those tokens would
    index outside the embedding (a crash, or garbage on some devices) on the first prompt
    that holds one."""
    rows = getattr(hf_config, "vocab_size", None)
    size = len(tokenizer)
    if isinstance(rows, int) and size > rows:
        raise CheckpointError(
            f"the tokenizer {tokenizer_name} has {size} tokens but the model {model_name} has "
            f"{rows} (vocab_size, its embedding rows): ids {rows} and above have no "
            "embedding. Pass the tokenizer the model was trained with (--tokenizer), or "
            "none to use the model's own")


def chat_template_beside(path: Path) -> str | dict[str, str] | None:
    """The template of chat_template.jinja, else of chat_template.json (one template, or a
    list of {"name", "template"} as tokenizer_config.json may hold them); None without."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    file = path / "chat_template.json"
    if not file.is_file():
        return None
    try:
        template: Any = json.loads(file.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError) as exc:
        log.warning("ignoring %s: not a JSON object with a chat_template (%s)", file, exc)
        return None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        template = {t["name"]: t["template"] for t in template
                    if isinstance(t, dict) and {"name", "template"} <= t.keys()}
    if isinstance(template, (str, dict)) and template:
        return template
    log.warning("ignoring %s: its chat_template is not a template", file)
    return None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) printable character for each byte, reversed: bytes that
    print as themselves keep their character, the other 68 take U+0100 onwards in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(0x100 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The UTF-8 bytes one token stands for (OpenAI's log-probability `bytes`). `text` is
    the token decoded alone; when it holds U+FFFD, the token may be part of a character,
    whose bytes the decoded text lost: they are read from the vocabulary's piece instead
    (SentencePiece's byte fallback `<0xF0>`, or byte-level BPE's alphabet)."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if piece and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return text.encode("utf-8")
