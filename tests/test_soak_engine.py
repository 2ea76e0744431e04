"""The long soak, against `tpserve launch --tp 2` on the CPU (loopback only), with an API key:
rounds of concurrent streaming and non-streaming clients, a share vanishing mid-stream.
Afterwards the engine's gauges are at idle, 64 concurrent requests succeed, and the
driver's and shards' memory did not grow across rounds. Figures go to the test's output
(`-s`) and docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest
from server_process import launched_process
from soak_clients import all_succeed, soak

# The tiny test checkpoint has no chat template, so no chat requests here.
KINDS = ("tgi", "tgi_stream", "openai", "openai_stream")

ROUNDS = int(os.environ.get("TPSERVE_SOAK_ROUNDS", "20"))
CLIENTS = int(os.environ.get("TPSERVE_SOAK_CLIENTS", "64"))
KEY = "soak-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Hello world, this is", "Once upon a time", "In 1905,"]


def _tree(root: int) -> list[int]:
    """root and all its descendants, from /proc (Linux)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _rss_mb(root: int) -> dict[str, float]:
    """Resident memory of the driver actor and each shard actor, by Ray's process titles."""
    found: dict[str, float] = {}
    for pid in _tree(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        m = re.search(r"ray::(Driver|ShardWorker)", title)
        if m:
            rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
            name = m.group(1) if m.group(1) == "Driver" else f"shard-{pid}"
            found[name] = round(rss, 1)
    return found


def _engine_stats(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=HEADERS).text
    stats = dict(re.findall(r'^tpserve_engine\{stat="(\w+)"\} (\S+)$', text, re.MULTILINE))
    inflight = re.search(r"^tpserve_requests_inflight (\S+)$", text, re.MULTILINE).group(1)
    return {**{k: float(v) for k, v in stats.items()}, "http_inflight": float(inflight)}


def _wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        s = _engine_stats(url)
        idle = (s["running_sequences"] == 0 and s["waiting_sequences"] == 0
                and s["requests_inflight"] == 0 and s["http_inflight"] == 0
                and s["kv_blocks_free"] == s["kv_blocks_total"])
        if idle:
            return s
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {s}"
        time.sleep(0.2)


@pytest.mark.slow
def test_engine_soak_with_disconnects(llama_dir, tmp_path):
    args = ["--model", str(llama_dir), "--tp", "2", "--num-blocks", "1024",
            "--max-concurrent-requests", "256", "--request-timeout", "300"]
    with launched_process(args, tmp_path / "server.log", env={"TPSERVE_API_KEY": KEY}) as (
            proc, url):
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/generate", json={"inputs": "hi"}).status_code == 401
        big = b'{"inputs": "' + b"a " * (32 * 2**20) + b'"}'
        try:
            r = httpx.post(url + "/generate", content=big, timeout=60,
                           headers={**HEADERS, "content-type": "application/json"})
            assert r.status_code == 413
        except httpx.TransportError:
            pass
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 16}}
        reference = asyncio.run(all_succeed(url, 1, body, HEADERS))[0]

        figures = {"rounds": [], "clients_per_round": CLIENTS}
        start = time.monotonic()
        for i in range(ROUNDS):
            t0 = time.monotonic()
            report = asyncio.run(soak(url, rounds=1, clients=CLIENTS, prompts=PROMPTS,
                                      max_new=32, vanish=0.3, deadline_s=300, seed=i,
                                      headers=HEADERS, kinds=KINDS))
            idle = _wait_idle(url)
            figures["rounds"].append({
                "seconds": round(time.monotonic() - t0, 1), "outcomes": dict(report.outcomes),
                "slowest_s": round(report.slowest_s, 2), "rss_mb": _rss_mb(proc.pid),
                "kv_blocks_free": idle["kv_blocks_free"]})
            assert set(report.outcomes) <= {"completed", "vanished", "gave_up"}, report.outcomes
        figures["total_seconds"] = round(time.monotonic() - start, 1)
        results = asyncio.run(all_succeed(url, 64, body, HEADERS))
        assert all(r == reference for r in results)
        _wait_idle(url)
        print("SOAK FIGURES", json.dumps(figures))

    rss = [r["rss_mb"] for r in figures["rounds"]]
    assert rss[0] and set(rss[0]) == set(rss[-1]), rss  # same processes: nothing restarted
    # Warm-up allocations settle in the first rounds; after that, no growth beyond noise.
    settled = rss[min(2, len(rss) - 1)]
    for name, mb in rss[-1].items():
        assert mb <= settled[name] * 1.05 + 20, (name, settled[name], mb, rss)
