"""Engine metrics through ray.util.metrics: the recording API aggregates per publication (no
Ray call per token), gauges follow the engine to idle, and a real served engine's metrics show
up in the node's Prometheus export with the right values."""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from types import SimpleNamespace

import httpx
import pytest

from tpserve.cluster.ray_metrics import MAX_OBSERVATIONS, EngineMetrics


class FakeSink:
    """Records what a publication hands to Ray, one call list per metric."""

    instances: list[FakeSink] = []

    def __init__(self, tags: dict) -> None:
        self.tags, self.gauges, self.counters, self.observed = tags, {}, {}, {}
        self.calls = 0
        FakeSink.instances.append(self)

    def set(self, name, value):
        self.calls += 1
        self.gauges[name] = value

    def inc(self, name, value):
        self.calls += 1
        self.counters[name] = self.counters.get(name, 0) + value

    def observe(self, name, values):
        self.calls += 1
        self.observed.setdefault(name, []).extend(values)


def ev(finished: bool = False):
    return SimpleNamespace(finished=finished)


def test_recording_aggregates_and_idle_values_are_published():
    stats = {"ready": 1.0, "running_sequences": 2, "waiting_sequences": 1,
             "kv_blocks_free": 90, "kv_blocks_total": 100, "requests_inflight": 3}
    m = EngineMetrics(lambda: dict(stats), "acme/tiny", sink_factory=FakeSink)
    m.request_arrived(1)
    m.request_arrived(2)
    time.sleep(0.01)
    m.step_done([(1, ev()), (2, ev())], 0.02)  # first tokens: two TTFTs
    for _ in range(3):
        m.step_done([(1, ev()), (2, ev())], 0.01)  # two ITLs per step
    m.step_done([(1, ev(finished=True))], 0.01)
    m.request_ended(2)  # aborted
    m.publish()
    sink = FakeSink.instances[-1]
    assert sink.tags == {"model": "acme/tiny"}
    assert sink.counters == {"tpserve_generated_tokens": 9, "tpserve_steps": 5,
                             "tpserve_requests_finished": 2}
    ttft = sink.observed["tpserve_time_to_first_token_seconds"]
    assert len(ttft) == 2 and min(ttft) >= 0.01
    assert len(sink.observed["tpserve_inter_token_latency_seconds"]) == 7
    assert sink.observed["tpserve_step_seconds"] == [0.02, 0.01, 0.01, 0.01, 0.01]
    assert sink.gauges["tpserve_running_sequences"] == 2
    assert sink.gauges["tpserve_kv_blocks_used"] == 10
    assert sink.gauges["tpserve_tokens_per_second"] > 0
    # The engine went idle: the next publication says so, and adds nothing to the counters.
    stats.update(running_sequences=0, waiting_sequences=0, kv_blocks_free=100,
                 requests_inflight=0)
    m.publish()
    assert sink.gauges["tpserve_running_sequences"] == 0
    assert sink.gauges["tpserve_kv_blocks_used"] == 0
    assert sink.gauges["tpserve_tokens_per_second"] == 0
    assert sink.counters["tpserve_generated_tokens"] == 9
    assert not m._arrived and not m._last_token  # noqa: SLF001 - no per-request leak


def test_engine_thread_makes_no_sink_call_until_published():
    m = EngineMetrics(lambda: {}, "m", sink_factory=FakeSink)
    m.publish()
    sink = FakeSink.instances[-1]
    calls = sink.calls
    for i in range(1000):
        m.request_arrived(i)
        m.step_done([(i, ev(finished=True))], 0.001)
    assert sink.calls == calls  # recording alone never reaches the sink (Ray)
    m.publish()
    # Past MAX_OBSERVATIONS a publication hands Ray a uniform sample; counters stay exact.
    ttft = sink.observed["tpserve_time_to_first_token_seconds"]
    assert len(ttft) == MAX_OBSERVATIONS < 1000
    assert sink.counters["tpserve_generated_tokens"] == 1000


def test_a_sampled_histogram_keeps_the_distribution():
    m = EngineMetrics(lambda: {}, "m", sink_factory=FakeSink)
    m.publish()
    sink = FakeSink.instances[-1]
    values = [0.001 * (i % 100) for i in range(20 * MAX_OBSERVATIONS)]
    with m._lock:  # noqa: SLF001 - recorded inter-token gaps, as step_done leaves them
        m._pending.itl += values  # noqa: SLF001
    m.publish()
    got = sorted(sink.observed["tpserve_inter_token_latency_seconds"])
    assert len(got) == MAX_OBSERVATIONS
    assert set(got) <= set(values)
    # Uniform: the sample's mean and median stay near the recorded ones (0.0495).
    assert abs(sum(got) / len(got) - 0.0495) < 0.005
    assert abs(got[len(got) // 2] - 0.0495) < 0.01


def _export(ray) -> str:
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _value(text: str, name: str, model: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow
def test_served_engine_metrics_reach_rays_prometheus_export(ray_cluster, llama_dir):
    from tpserve.cluster.driver import Driver
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    ray = ray_cluster
    model = f"metrics-{uuid.uuid4().hex[:6]}"  # tags this test's series apart
    cfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id=model,
                                         max_model_len=128),
                       parallel=ParallelConfig(tp_size=2, device="cpu", cpus_per_shard=1),
                       cache=CacheConfig(block_size=4, num_blocks=128))
    driver = ray.remote(Driver).options(num_cpus=0, max_concurrency=4).remote(
        cfg, "127.0.0.1", 0, "warning")
    try:
        url = ray.get(driver.start.remote())
        ray.get(driver.wait_ready.remote(120))
        n, new = 3, 6
        for prompt in ("Hello world", "The quick brown fox", "A")[:n]:
            r = httpx.post(url + "/generate", timeout=60, json={
                "inputs": prompt, "parameters": {"max_new_tokens": new}})
            assert r.status_code == 200, r.text
        want = n * new
        deadline = time.monotonic() + 30
        while True:
            text = _export(ray)
            tokens = _value(text, "ray_tpserve_generated_tokens_total", model)
            ttft = _value(text, "ray_tpserve_time_to_first_token_seconds_count", model)
            running = _value(text, "ray_tpserve_running_sequences", model)
            if tokens == want and ttft == n and running == 0:
                break
            assert time.monotonic() < deadline, (tokens, ttft, running, re.findall(
                r"^ray_tpserve\w+", text, re.M)[:20])
            time.sleep(0.5)
        assert _value(text, "ray_tpserve_ready", model) == 1
        assert _value(text, "ray_tpserve_kv_blocks_free", model) == 128
        itl = _value(text, "ray_tpserve_inter_token_latency_seconds_count", model)
        assert itl == n * (new - 1)
    finally:
        ray.get(driver.stop.remote())
        ray.kill(driver)
