"""Which files make a directory a tokenizer: what the launch checks in a model directory,
in a --tokenizer directory, and in a hub snapshot fetched for --tokenizer (hub.py). Apart
from tokenizer.py, which asks hub.py for a --tokenizer hub id, so that neither imports the
other."""

from __future__ import annotations

from pathlib import Path

# Any one of these is enough for AutoTokenizer (tokenizer_config.json alone: byte-level
# tokenizers such as ByT5's have no vocabulary file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "vocab.json", "vocab.txt")


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES) \
        or any(path.glob("*.model"))
