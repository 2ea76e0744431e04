"""Run `tpserve launch` as a subprocess, as a user would, and stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(args: list[str], log_path: Path, ready_timeout: float = 240.0,
             env: dict[str, str] | None = None):
    """Start `tpserve launch ARGS --port P`, wait for GET /health == 200, yield the URL;
    on exit send SIGINT, then SIGKILL if it lingers (Ray's processes go with it)."""
    with launched_process(args, log_path, ready_timeout, env) as (_, url):
        yield url


@contextmanager
def launched_process(args: list[str], log_path: Path, ready_timeout: float = 240.0,
                     env: dict[str, str] | None = None):
    """As `launched`, yielding (the launcher's Popen, the URL); `env` adds variables."""
    port = free_port()
    extra_env = env
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    env.update(extra_env or {})
    # Quiet by default; a test that reads the log passes its own --log-level (the last wins).
    cmd = [sys.executable, "-m", "tpserve.cli", "launch", "--log-level", "warning", *args,
           "--port", str(port), "--no-dashboard", "--cpus-per-shard", "1"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n"
                                   + log_path.read_text()[-4000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not healthy in time:\n" + log_path.read_text()[-4000:])
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
