"""`tpserve launch --address` joins an existing Ray cluster of two nodes and places one shard
on each (the shards find each other over TCP, as they would across machines)."""

from __future__ import annotations

import httpx
import pytest
from server_process import launched
from tiny_models import hf_greedy
from transformers import AutoTokenizer

import tpserve


@pytest.mark.slow
def test_launch_joins_two_node_cluster(llama_dir, tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ref = hf_greedy(llama_dir, ["Hello world"], 12)[0]
        text = AutoTokenizer.from_pretrained(llama_dir).decode(ref, skip_special_tokens=True)
        # One CPU per node and one per shard: the two shards must land on different nodes.
        with launched(["--model", str(llama_dir), "--tp", "2", "--address", cluster.address,
                       "--num-blocks", "128"], tmp_path / "server.log") as url:
            r = tpserve.Client(url, timeout=60).generate("Hello world", max_new_tokens=12)
            assert r.generated_text == text
            assert httpx.get(url + "/info").json()["tp_size"] == 2
    finally:
        cluster.shutdown()
