"""Ray's state API (what `ray list actors` and the dashboard's actors view read) lists the
shard actors of a served model by name, with their rank and device. Runs in a child process:
the state API needs Ray's dashboard, which the test session's shared cluster runs without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, socket, sys
    import ray
    from ray.util.state import list_actors
    sys.path.insert(0, "tests")
    from test_control_channel import core_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=True, dashboard_port=port, namespace="state-test",
             log_to_driver=False)
    client = core_client(sys.argv[1], 2)
    try:
        actors = list_actors(address=f"http://127.0.0.1:{port}",
                             filters=[("state", "=", "ALIVE")], detail=True)
        print(json.dumps([{"name": a.name, "class": a.class_name, "repr": a.repr_name}
                          for a in actors]))
    finally:
        client.shutdown()
        ray.shutdown()
""")


@pytest.mark.slow
def test_state_api_lists_the_shard_actors_with_rank_and_device(llama_dir):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    r = subprocess.run([sys.executable, "-c", CHILD, str(llama_dir)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    actors = json.loads(r.stdout.strip().splitlines()[-1])
    shards = sorted((a for a in actors if a["name"].startswith("shard-")),
                    key=lambda a: a["name"])
    assert [a["name"] for a in shards] == ["shard-0", "shard-1"], actors
    for rank, a in enumerate(shards):
        assert f"rank {rank}/2" in a["repr"] and "cpu" in a["repr"], a
