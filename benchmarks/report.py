"""How a benchmark hands over its table: printed, and appended to --out when given."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
