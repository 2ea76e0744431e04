"""The forked-shard harness of the oracle matrices (forked_shards.py): ranks come from the
fork server, not the test process, so Ray keeps running beside them; a rank that dies is
reported at once, with its signal; ranks whose test process is gone exit."""

from __future__ import annotations

import os
import time

import pytest
from engine_utils import greedy, make_engine
from forked_shards import ForkedShards
from tiny_models import PROMPTS, hf_greedy

from tpserve.executor.base import ShardFailedError


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state


def _gone(procs, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(p.is_alive() for p in procs):
            return True
        time.sleep(0.2)
    return False


def test_ranks_fork_from_the_server_while_ray_runs(ray_cluster, llama_dir):
    """Not children of the test process (which runs Ray here), and Ray is left running;
    the tokens are transformers'."""
    engine = make_engine(llama_dir, 2, forked=True)
    try:
        shards = engine.executor
        assert isinstance(shards, ForkedShards)
        parents = {_parent_pid(p.pid) for p in shards.procs}
        assert os.getpid() not in parents and len(parents) == 1, parents
        assert ray_cluster.is_initialized()
        assert greedy(engine, PROMPTS[:2], 4) == hf_greedy(llama_dir, PROMPTS[:2], 4)
    finally:
        engine.shutdown()


def test_a_rank_that_aborts_is_reported_at_once(llama_dir):
    """A rank that aborts mid-call (as glibc does on a corrupt heap) is reported dead with
    its signal at once, not after the 300 s call timeout; a call after that says it is
    gone. (Its Python stack goes to the fork server's stderr: pytest's capture of the
    session, shown under the test that was running.)"""
    engine = make_engine(llama_dir, 2, forked=True)
    shards = engine.executor
    try:
        t0 = time.monotonic()
        shards._send(0, "abort")
        with pytest.raises(ShardFailedError, match="shard 0 exited .killed by SIGABRT"):
            shards._recv(0)
        assert time.monotonic() - t0 < 30
        with pytest.raises(ShardFailedError, match="shard 0 is gone .killed by SIGABRT"):
            shards.health()
    finally:
        engine.shutdown()


def test_ranks_exit_when_the_test_process_is_gone(llama_dir):
    """Killed test process, as the pipes see it: every end on its side closes. Rank 0 reads
    EOF and exits, and the follower, waiting for rank 0's next step in a collective, fails
    it and exits too; none is left running (a CI job stopped by its timeout left ranks
    forked from the test process running: each later rank held the earlier ranks' ends)."""
    engine = make_engine(llama_dir, 2, forked=True)
    shards = engine.executor
    procs = list(shards.procs)
    assert shards.following  # rank 1 is in its follow loop
    try:
        for conn in shards.conns:
            conn.close()
        assert _gone(procs, 60), [p.is_alive() for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shards.procs, shards.conns = [], []
