"""`--replicas` with an API key on Ray Serve's own proxy: every path reaches tpserve's app
(and its key check) except the two the proxy answers itself, /-/healthz and /-/routes, whose
answers are only what docs/replicas.md says (no model, prompt or engine data)."""

from __future__ import annotations

import httpx
import pytest
from test_serve_e2e import free_port

from tpserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
)

pytestmark = pytest.mark.slow

KEY = "k-serve-test"


@pytest.fixture(scope="module")
def keyed_url(ray_for_module, llama_dir):
    from tpserve.serve import app

    cfg = EngineConfig(
        model=ModelConfig(path=str(llama_dir), model_id="tiny", max_model_len=128),
        parallel=ParallelConfig(tp_size=1, device="cpu", cpus_per_shard=1),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_concurrent_requests=8))
    spec = app.ReplicaSpec(num_replicas=1, shard_cpus=0.5, health_check_period_s=1.0)
    url = app.run(cfg, spec, "127.0.0.1", free_port(), server=ServerConfig(api_keys=(KEY,)))
    yield url
    app.shutdown()


def test_only_the_proxys_own_routes_answer_without_the_key(keyed_url):
    url = keyed_url
    auth = {"Authorization": f"Bearer {KEY}"}
    # The proxy's own answers: liveness and the route table (app name per prefix).
    r = httpx.get(url + "/-/healthz", timeout=10)
    assert (r.status_code, r.text) == (200, "success")
    r = httpx.get(url + "/-/routes", timeout=10)
    assert (r.status_code, r.json()) == (200, {"/": "tpserve"})
    # Everything else is tpserve's app: refused without the key, served with it.
    for method, path in [("GET", "/info"), ("GET", "/metrics"), ("GET", "/docs"),
                         ("GET", "/openapi.json"), ("GET", "/v1/models"),
                         ("POST", "/generate"), ("GET", "/-/other"), ("GET", "/-/routes/"),
                         ("GET", "//-/routes"), ("GET", "/nowhere")]:
        r = httpx.request(method, url + path, json={"inputs": "a"}, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert r.json()["error_type"] == "unauthorized", (path, r.text)
    r = httpx.post(url + "/generate", json={"inputs": "Hello",
                                           "parameters": {"max_new_tokens": 2}},
                   headers=auth, timeout=60)
    assert r.status_code == 200, r.text
