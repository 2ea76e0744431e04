"""Whether a cached branch or tag is still what the hub serves (hub.ensure_model uses it).

A snapshot found in the cache under a branch (main by default) or a tag was that branch's
commit when it was downloaded; the repository may have moved since. As transformers and
`hf download` do, an online launch asks the hub which commit the name points to now (one
metadata request, bounded by the download timeout) and downloads that commit when it is not
the cached one (ask_timeout bounds the question). A full commit id names one snapshot
forever, so it is never asked about.
"""

from __future__ import annotations

import re
from pathlib import Path

from tpserve.hub_errors import first_line, redact
from tpserve.hub_stall import StallGuard, guarded

FULL_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit(revision: str | None) -> bool:
    return revision is not None and FULL_COMMIT.fullmatch(revision) is not None


def ask_timeout(download_timeout: float) -> float:
    """Seconds the hub may take to say where a branch points: huggingface_hub's
    HF_HUB_ETAG_TIMEOUT (10 by default; what transformers waits on the same question before
    it falls back to its cache), at most the download's silence bound. Not the download's
    60 s: a firewall that drops packets would hold every launch of a cached model that long."""
    from huggingface_hub import constants

    etag = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10) or 10)
    return min(download_timeout, etag)


def current_commit(model_id: str, revision: str | None, timeout: float) -> tuple[str | None, str]:
    """(the commit `revision` of `model_id` points to on the hub now, "") or, where the hub
    could not say, (None, why): it could not be reached, stayed silent for `timeout` seconds,
    or answered with an error."""
    from huggingface_hub import HfApi

    guard = StallGuard(timeout)
    try:
        with guarded(guard):
            info = HfApi().model_info(model_id, revision=revision or "main", timeout=timeout,
                                      expand=["sha"])
    except Exception as exc:  # noqa: BLE001 - network, HTTP and hub errors alike: the cache serves
        stalled = guard.behind(exc)
        return None, redact(str(stalled) if stalled is not None else first_line(exc))
    sha = getattr(info, "sha", None)
    if not is_commit(sha):
        return None, f"its answer named no commit ({sha!r})"
    return sha, ""


def point_ref(cache: str, model_id: str, revision: str | None, commit: str) -> None:
    """Record in the hub cache that `revision` (a branch or tag) is now `commit`, as
    huggingface_hub does after a download, so that an offline launch serves that commit too."""
    ref = Path(cache) / f"models--{model_id.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    except OSError:  # a read-only cache: the online launches still ask the hub
        pass
