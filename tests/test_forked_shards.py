"""The forked-shard harness of the oracle matrices (forked_shards.py): it never forks a
process connected to Ray, and a rank that dies is reported at once, with the signal."""

from __future__ import annotations

import os
import signal
import time

import pytest
from engine_utils import make_engine
from forked_shards import ForkedShards

from tpserve.executor.base import ShardFailedError


def test_forking_stops_ray_and_a_later_test_gets_it_back(ray_cluster, llama_dir):
    assert ray_cluster.is_initialized()
    engine = make_engine(llama_dir, 2, forked=True)
    try:
        assert not ray_cluster.is_initialized()  # stopped before the fork
    finally:
        engine.shutdown()


def test_ray_cluster_runs_again_after_a_fork(ray_cluster):
    assert ray_cluster.is_initialized()
    assert ray_cluster.cluster_resources().get("CPU") == 4


def test_a_rank_killed_by_a_signal_is_reported_at_once(ray_cluster, llama_dir):
    """Ray's native fatal-signal handler, inherited, printed and then hung: the test process
    waited out its 300 s call timeout. The rank now dies of the signal, and its death is
    reported with the signal, whether it came during a call or before the next one."""
    engine = make_engine(llama_dir, 2, forked=True)
    shards = engine.executor
    assert isinstance(shards, ForkedShards)
    pid = shards.procs[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)  # the call is on its way when the signal lands
        shards._send(0, "health")
        os.kill(pid, signal.SIGABRT)
        os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        with pytest.raises(ShardFailedError, match="shard 0 exited .killed by SIGABRT"):
            shards._recv(0)
        assert time.monotonic() - t0 < 30
        with pytest.raises(ShardFailedError, match="shard 0 is gone .killed by SIGABRT"):
            shards.health()
    finally:
        engine.shutdown()
