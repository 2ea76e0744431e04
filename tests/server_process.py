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


def listening_sockets(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket that one of `pids` holds, read from
    /proc (Linux): the table of listening sockets, and each process's descriptors to tell
    whose they are. An IPv4-mapped IPv6 address is given as its IPv4 form."""
    import ipaddress

    owner: dict[str, int] = {}  # socket inode -> pid
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:  # gone, or not ours to read
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in owner:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1] for i in range(0, 2 * width, 8))
            addr = ipaddress.ip_address(raw)
            if addr.version == 6 and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            found.append((str(addr), int(hexport, 16), owner[cols[9]]))
    return found
