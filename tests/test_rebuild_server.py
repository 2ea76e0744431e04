"""`tpserve launch --tp 2`: a shard process killed during a long generation is rebuilt
without a restart; killed again once --max-rebuilds is spent, the server stays up and
answers 503 saying why."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_process import launched_process
from tiny_models import hf_greedy
from transformers import AutoTokenizer

PROMPT = "The quick brown fox"


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Ray's raylet and its workers are the launcher's)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command may hold spaces and parentheses: ppid follows the last ")".
                parent[int(entry.name)] = int((entry / "stat").read_text()
                                              .rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def shard_pid(launcher: int, actor_class: str = "FollowerActor") -> int:
    """A shard's process: Ray titles an actor's process `ray::<class>` (rank 0 is the
    `EngineCoreActor`, ranks 1.. are `FollowerActor`s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in descendants(launcher):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if title.startswith(f"ray::{actor_class}".encode()):
                return pid
        time.sleep(0.5)
    raise AssertionError(f"no ray::{actor_class} process under the launcher")


def wait_health(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"/health did not answer {status} in {timeout}s"
        time.sleep(0.2)


@pytest.mark.slow
def test_killed_shard_is_rebuilt_then_budget_spent_answers_503(llama_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    expected = tok.decode(hf_greedy(llama_dir, [PROMPT], 12)[0], skip_special_tokens=True)
    args = ["--model", str(llama_dir), "--tp", "2", "--num-blocks", "128",
            "--max-rebuilds", "1", "--rebuild-backoff", "0.5"]
    with launched_process(args, tmp_path / "server.log") as (proc, url):
        victim = shard_pid(proc.pid)  # rank 1, mid-collective with rank 0
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 480, "details": True}}
        tokens, error = 0, None
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    error = event
                    break
                tokens += 1
                if tokens == 3:
                    os.kill(victim, signal.SIGKILL)
                    killed_at = time.monotonic()
        # The request in flight ends, in bounded time, with the documented error.
        assert error is not None and error["error_type"] == "shard_lost", error
        assert 3 <= tokens < 480 and time.monotonic() - killed_at < 60
        # Unhealthy while the group is rebuilt (the back-off alone lasts 0.5 s)...
        r = httpx.get(url + "/health", timeout=5)
        assert r.status_code == 503 and "a shard was lost" in r.json()["error"]
        # ...then healthy again, without a restart, and right.
        wait_health(url, 200, 180)
        assert proc.poll() is None
        r = httpx.post(url + "/generate", timeout=60,
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})
        assert r.status_code == 200 and r.json()["generated_text"] == expected
        info = httpx.get(url + "/info", timeout=5).json()
        assert (info["replica_state"], info["rebuilds"], info["rebuilds_left"]) == \
            ("serving", 1, 0)
        assert 'tpserve_engine{stat="rebuilds"} 1.0' in httpx.get(url + "/metrics").text

        # The budget is spent: a second loss, rank 0 this time (noticed while idle), is final.
        os.kill(shard_pid(proc.pid, "EngineCoreActor"), signal.SIGKILL)
        r = wait_health(url, 503, 60)
        assert "--max-rebuilds 1" in r.json()["error"] and "shard 0" in r.json()["error"]
        r = httpx.post(url + "/generate", timeout=60,
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 503 and "restart tpserve launch" in r.json()["error"]
        assert proc.poll() is None
