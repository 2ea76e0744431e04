"""A hub download's progress as a log line every PROGRESS_EVERY_S seconds, where
huggingface_hub's progress bars do not show: its byte bars turn themselves off when stderr is
not a terminal (a server's log file, a container, systemd), which left a download of many
gigabytes silent from its first line to its end. Counts the bytes arriving in the model's
blobs folder of the hub cache, so it needs nothing from huggingface_hub's internals."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0


def bars_show() -> bool:
    """Whether huggingface_hub's byte bars show: stderr is a terminal, bars not disabled."""
    from huggingface_hub import constants

    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and not constants.HF_HUB_DISABLE_PROGRESS_BARS


class DownloadProgress:
    """While the block runs, logs what arrived so far (and of how much, once `total` is
    known), unless progress bars show."""

    def __init__(self, model_id: str, cache: str, every: float | None = None) -> None:
        self.model_id, self.total = model_id, None
        self.blobs = Path(cache) / f"models--{model_id.replace('/', '--')}" / "blobs"
        self.every = PROGRESS_EVERY_S if every is None else every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hub-progress")

    def __enter__(self) -> DownloadProgress:
        if not bars_show():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        start, began = self._bytes(), time.monotonic()
        while not self._stop.wait(self.every):
            got = self._bytes() - start
            rate = got / max(time.monotonic() - began, 1e-9)
            of = f" of about {_size(self.total)}" if self.total else ""
            log.info("downloading %s: %s so far%s, %s/s", self.model_id, _size(got), of,
                     _size(rate))

    def _bytes(self) -> int:
        total = 0
        try:
            for f in self.blobs.iterdir():
                try:
                    total += f.stat().st_size
                except OSError:  # renamed from *.incomplete meanwhile
                    pass
        except OSError:  # not created yet
            return 0
        return total


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
