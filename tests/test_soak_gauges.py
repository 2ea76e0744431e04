"""A freshly started replica reports its scheduler and KV-cache gauges before its first
request: a dashboard or alert on kv_blocks_free sees the idle values, not a gap."""

from __future__ import annotations

from test_control_channel import core_client

from tpserve.engine.async_engine import AsyncEngine


def test_fresh_replica_reports_idle_gauges_before_any_request(ray_cluster, llama_dir):
    backend = AsyncEngine(lambda: core_client(llama_dir, 1), "tiny", 8)
    backend.start()
    backend.wait_ready(120)
    try:
        s = backend.stats()
        assert s["kv_blocks_total"] == 256, s  # core_client's CacheConfig(num_blocks=256)
        assert s["kv_blocks_free"] == 256, s
        assert s["running_sequences"] == 0 and s["waiting_sequences"] == 0, s
        assert s["work_tokens"] == 0, s
    finally:
        backend.stop()
