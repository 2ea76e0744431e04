"""`tpserve launch --address` as a Ray user meets it: two deployments on one existing
cluster (two models, or two versions side by side) each get their own, self-describing
actor names, both serve, and stopping one leaves the other and the cluster running."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_process import launched
from tiny_models import hf_greedy
from transformers import AutoTokenizer

import tpserve

LIST = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
        "print(json.dumps(sorted(a['name'] for a in ray.util.list_named_actors("
        "all_namespaces=True) if a['namespace'] == 'tpserve')))")


def named_actors(address: str) -> list[str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    r = subprocess.run([sys.executable, "-c", LIST % address], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_launches_share_one_cluster_with_their_own_actor_names(llama_dir, tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        ref = hf_greedy(llama_dir, ["Hello world"], 8)[0]
        text = AutoTokenizer.from_pretrained(llama_dir).decode(ref, skip_special_tokens=True)
        args = ["--model", str(llama_dir), "--tp", "2", "--address", cluster.address,
                "--num-blocks", "64"]
        with launched(args, tmp_path / "first.log") as first:
            with launched(args, tmp_path / "second.log") as second:
                for url in (first, second):
                    r = tpserve.Client(url, timeout=60).generate("Hello world",
                                                                 max_new_tokens=8)
                    assert r.generated_text == text
                names = named_actors(cluster.address)
                assert "driver" in names and "shard-0" in names and "shard-1" in names
                other = [n for n in names if n.startswith("driver-")]
                assert len(other) == 1, names
                suffix = other[0][len("driver"):]
                # The second deployment's shards carry its driver's suffix.
                assert {f"shard-0{suffix}", f"shard-1{suffix}"} <= set(names), names
                assert len(names) == 6, names
            # The second one stopped: its actors are gone, the first still serves.
            assert named_actors(cluster.address) == ["driver", "shard-0", "shard-1"]
            r = tpserve.Client(first, timeout=60).generate("Hello world", max_new_tokens=8)
            assert r.generated_text == text
        assert named_actors(cluster.address) == []
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_launcher_exits_nonzero_when_its_driver_actor_dies(tmp_path):
    """The driver actor (HTTP server and engine loop) is killed: the launcher used to keep
    running with nothing listening, so a supervisor never restarted it."""
    import signal
    import time

    import httpx
    from server_process import launched_process
    from test_rebuild_server import descendants, shard_pid

    log = tmp_path / "server.log"
    with launched_process(["--tp", "2", "--log-level", "info"], log) as (proc, url):
        assert httpx.get(url + "/health").status_code == 200
        ray_pids = descendants(proc.pid)  # raylet, GCS, workers: the launcher's children
        os.kill(shard_pid(proc.pid, "Driver"), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.returncode == 1, log.read_text()[-3000:]
        assert "the driver actor died" in log.read_text()
        deadline = time.monotonic() + 20
        while [p for p in ray_pids if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in ray_pids if _running(p)], "Ray processes left behind"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_replicas_a_joined_cluster_cannot_hold_warn_and_ctrl_c_stops_the_wait(llama_dir, tmp_path):
    """3 CPUs cannot hold 2 replicas of 2 one-CPU shards: the launch said nothing (Serve logs
    every 30 s that a replica is not scheduled) and Ctrl-C did not stop it; now it names what
    is missing at once, and SIGINT ends the wait and deletes the application."""
    import signal
    import time

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    proc = None
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        log_path = tmp_path / "server.log"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tpserve.cli", "launch", "--model", str(llama_dir),
                 "--tp", "2", "--replicas", "2", "--cpus-per-shard", "1", "--address",
                 cluster.address, "--port", "0", "--num-blocks", "128"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 90
        while "Waiting for the cluster to scale up" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        assert "need 2.25 CPU each, and the cluster has 3 CPU in all: it holds 1" in \
            log_path.read_text()
        time.sleep(15)  # Serve is deploying, one replica unscheduled
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=45) == 0
        text = log_path.read_text()
        assert "stopped before the replicas were ready" in text, text[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        cluster.shutdown()


# From the GCS (ray.util.state would need the cluster's dashboard, off in these tests): every
# actor the cluster knows, dead ones included, and every placement group.
STATE = ("import json, ray; from ray._private import state; "
         "ray.init(address=%r, log_to_driver=False); "
         "print(json.dumps({'actors': [[a['Name'], a['ActorClassName'], a['State']] "
         "for a in state.actors().values()], 'groups': [[g['name'], "
         "g['state']] for g in ray.util.placement_group_table().values()]}))")


def cluster_state(address: str) -> dict:
    """Actors and placement groups of the cluster, read by a second driver."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    r = subprocess.run([sys.executable, "-c", STATE % address], capture_output=True,
                       text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_joined_cluster_keeps_running_and_holds_nothing_of_tpserve_after_it_stops(
        llama_dir, tmp_path):
    """`--address` on an existing cluster: its placement group is named for the shards it
    holds (the dashboard showed `tpserve-<random>`), and once tpserve stops no actor of it is
    alive and no placement group of it is left, while the cluster keeps running."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        args = ["--model", str(llama_dir), "--tp", "2", "--address", cluster.address,
                "--num-blocks", "64"]
        with launched(args, tmp_path / "launch.log") as url:
            assert tpserve.Client(url, timeout=60).generate("Hello", max_new_tokens=2)
            state = cluster_state(cluster.address)
            alive = {(n, c) for n, c, s in state["actors"] if s == "ALIVE"}
            assert {("driver", "Driver"), ("shard-0", "EngineCoreActor"),
                    ("shard-1", "FollowerActor")} <= alive, state
            assert ["tpserve-shards", "CREATED"] in state["groups"], state
        state = cluster_state(cluster.address)  # the cluster still answers
        assert not [a for a in state["actors"] if a[2] != "DEAD"], state
        assert not [g for g in state["groups"] if g[1] != "REMOVED"], state
    finally:
        cluster.shutdown()
