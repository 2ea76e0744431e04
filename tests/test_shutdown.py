"""SIGTERM on `tpserve launch`: new requests get 503 at once, the request in flight still
completes, the process exits 0, and no Ray process of the cluster it started is left."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import launched_process

import tpserve


def ray_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the cluster's temp dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{proc.name}: {cmd[:160]}")
    return found


@pytest.mark.slow
def test_sigterm_drains_then_exits_leaving_no_ray_processes(tmp_path):
    # A short, unique Ray temp dir (unix socket paths are limited to ~107 bytes): every
    # raylet, GCS and worker of the server's cluster has it on its command line.
    ray_tmp = tempfile.mkdtemp(prefix="tpsd", dir="/tmp")
    env = {"RAY_TMPDIR": ray_tmp}
    with launched_process(["--shutdown-timeout", "60", "--num-blocks", "128"],
                          tmp_path / "server.log", env=env) as (proc, url):
        assert ray_processes(ray_tmp), "the marker does not find the cluster's processes"
        events: list = []
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                client = tpserve.Client(url, timeout=120)
                for ev in client.generate_stream("The default value of", max_new_tokens=600):
                    events.append(ev)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        while not events and reader.is_alive():
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "still healthy 10s after SIGTERM"
            time.sleep(0.05)
        refused = httpx.post(url + "/generate", timeout=10,
                             json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        assert reader.is_alive(), "the long request finished before the drain could be seen"
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]
        reader.join(timeout=120)
        assert not failure, failure
        assert len(events) == 600 and events[-1].details.finish_reason == "length"
        assert proc.wait(timeout=60) == 0
    time.sleep(1)  # the last workers exit right after the raylet that owns them
    assert ray_processes(ray_tmp) == []
    shutil.rmtree(ray_tmp, ignore_errors=True)
