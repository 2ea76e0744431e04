"""--placement maps onto Ray placement-group strategies; strict placements a cluster can never
hold are refused at once, naming the resources; spread puts tp = 2 on two nodes of a real
two-node cluster and still matches transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_process import launched
from tiny_models import hf_greedy

import tpserve
from tpserve.cluster.placement import (
    PLACEMENTS,
    check_capacity,
    check_placement,
    place_shards,
    ray_strategy,
)

SHARD = {"CPU": 2.0}


def test_each_placement_is_a_ray_strategy():
    from ray.util.placement_group import VALID_PLACEMENT_GROUP_STRATEGIES

    assert {ray_strategy(p) for p in PLACEMENTS} == set(VALID_PLACEMENT_GROUP_STRATEGIES)
    assert ray_strategy("spread") == "SPREAD" and ray_strategy("strict-pack") == "STRICT_PACK"
    with pytest.raises(ValueError, match="pack, spread, strict-pack, strict-spread"):
        ray_strategy("scatter")


def test_strict_spread_needs_a_node_per_shard():
    nodes = [{"CPU": 4.0}, {"CPU": 1.0}]  # only the first can hold a 2-CPU shard
    check_placement("strict-spread", SHARD, 1, nodes)
    with pytest.raises(RuntimeError) as info:
        check_placement("strict-spread", SHARD, 2, nodes)
    msg = str(info.value)
    assert "only 1 node(s)" in msg and "2 CPU" in msg and "--placement spread" in msg
    check_placement("spread", SHARD, 2, nodes)  # best effort: Ray packs what it cannot spread


def test_strict_pack_needs_one_node_for_all_shards():
    nodes = [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 2.0}]
    bundle = {"GPU": 1.0, "CPU": 1.0}
    check_placement("strict-pack", bundle, 2, nodes)
    with pytest.raises(RuntimeError) as info:
        check_placement("strict-pack", bundle, 4, nodes)
    msg = str(info.value)
    assert "needs 4 GPU, 4 CPU" in msg and "the largest node has 2 GPU, 4 CPU" in msg
    check_placement("pack", bundle, 4, nodes)  # PACK spills over to the second node


def test_shards_bigger_than_every_node_are_refused_though_the_total_fits():
    """A bundle never spans nodes: 3-CPU shards on 2-CPU nodes wait forever (the launch used
    to sit silent for 120 s, then name only the cluster's totals)."""
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    check_capacity({"CPU": 2.0}, 2, nodes)
    with pytest.raises(RuntimeError) as info:
        check_capacity({"CPU": 3.0}, 1, nodes)
    msg = str(info.value)
    assert "hold only 0" in msg and "the largest has 2 CPU" in msg and "--cpus-per-shard" in msg
    with pytest.raises(RuntimeError, match="hold only 2"):  # 5 + 1 CPUs: 2 shards, not 3
        check_capacity({"CPU": 2.0}, 3, [{"CPU": 5.0}, {"CPU": 1.0}])
    with pytest.raises(RuntimeError, match=r"needs 2 GPU \(the cluster has 1\)"):
        check_capacity({"GPU": 1.0, "CPU": 1.0}, 2, [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0}])


def test_a_joined_cluster_that_cannot_place_says_why_when_the_wait_ends(ray_cluster, caplog):
    """On a joined cluster the refusal is a warning (it may scale up); when the wait ends the
    error repeats what is missing rather than only Ray's resource table."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        place_shards({"CPU": 3.0}, 2, joined_cluster=True, timeout_s=1.0)
    msg = str(info.value)
    assert "within 1s" in msg and "--tp 2 needs 6 CPU (the cluster has 4)" in msg, msg
    assert "node:" not in msg and "memory" not in msg  # not Ray's internal resources
    assert "in case the cluster scales up" in caplog.text
    assert time.monotonic() - t0 < 30


def _placement_groups(address: str) -> list[dict]:
    """The cluster's placement groups, read by a second Ray driver (this test process may
    hold the session's own cluster)."""
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
            "print(json.dumps(list(ray.util.placement_group_table().values())))")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_nodes():
    """One two-node cluster (2 CPUs per node) for every placement case: each launch joins
    it and gives its placement group back when it stops (the case checks only the group it
    made), and starting a cluster per case took a third of each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("placement", "tp", "used_nodes"),
                         [("spread", 2, 2), ("pack", 2, 1), ("pack", 4, 2), ("spread", 4, 2)])
def test_placement_on_two_nodes(two_nodes, llama_dir, tmp_path, placement, tp, used_nodes):
    from transformers import AutoTokenizer

    # Two CPUs per node: PACK puts both 1-CPU shards of tp 2 on one node and spills tp 4
    # over to the second; SPREAD uses both nodes. Either way outputs equal transformers'.
    ref = hf_greedy(llama_dir, ["Hello world"], 12)[0]
    text = AutoTokenizer.from_pretrained(llama_dir).decode(ref, skip_special_tokens=True)
    with launched(["--model", str(llama_dir), "--tp", str(tp), "--address",
                   two_nodes.address, "--placement", placement, "--num-blocks", "128"],
                  tmp_path / "server.log") as url:
        r = tpserve.Client(url, timeout=60).generate("Hello world", max_new_tokens=12)
        assert r.generated_text == text
        assert httpx.get(url + "/info").json()["placement"] == placement
        groups = [g for g in _placement_groups(two_nodes.address)
                  if g["name"].startswith("tpserve-") and g["state"] == "CREATED"]
        # One group: an earlier case's launch gave its group back when it stopped.
        assert len(groups) == 1 and groups[0]["strategy"] == ray_strategy(placement), groups
        nodes = groups[0]["bundles_to_node_id"]
        assert len(nodes) == tp and len(set(nodes.values())) == used_nodes, nodes


def test_a_placement_that_waits_reports_what_it_lacks_until_it_ends(ray_cluster):
    """What GET /health shows while a rebuild waits for resources (engine/build_wait.py):
    the shard size, what is free, what the cluster lacks, and that the wait resumes."""
    from tpserve.engine.build_wait import reporting_waits

    seen: list = []
    with reporting_waits(seen.append), pytest.raises(RuntimeError, match="within 3s"):
        place_shards({"CPU": 3.0}, 2, joined_cluster=True, timeout_s=3.0)
    assert len(seen) >= 2 and seen[-1] is None, seen
    msg = seen[0]
    assert msg.startswith("waiting for cluster resources: Ray cannot place 2 shard(s) of "
                          "3 CPU each yet (free now: 4 CPU)"), msg
    assert "--tp 2 needs 6 CPU (the cluster has 4)" in msg and "goes on by itself" in msg
