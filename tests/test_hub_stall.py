"""A hub (or proxy) that accepts the connection and then says nothing must not hang a launch:
the download fails within the silence allowed, in one line naming the hub, the wait and what
to do."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hub_server import SilentHub
from test_hub import hub_env

ENSURE = "from tpserve.hub import ensure_model; print(ensure_model('acme/tiny'))"


def run_python(code: str, env: dict[str, str], limit: float = 20.0):
    """`code` in a fresh interpreter (huggingface_hub reads HF_* at import), killed after
    `limit` seconds so that a hang fails the test instead of hanging it."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=limit)
    return out, time.monotonic() - start


def test_silent_hub_fails_with_a_message_instead_of_hanging(tmp_path: Path):
    """The first request (the revision's metadata) gets no answer: huggingface_hub sends it
    without a read timeout, so this waited forever. HF_HUB_DOWNLOAD_TIMEOUT, set by the
    user, is the silence allowed."""
    with SilentHub() as hub:
        env = hub_env(tmp_path, None)
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DOWNLOAD_TIMEOUT="2")
        out, took = run_python(ENSURE, env)
        assert hub.accepted >= 1
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in err and "Traceback" not in out.stdout
    assert hub.url in err and "2 s" in err, err
    assert took < 15, f"took {took:.1f} s for a 2 s timeout"
