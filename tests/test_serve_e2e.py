"""`--tp 2 --replicas 2` on Ray Serve over the session's local Ray cluster: outputs equal
transformers', both replicas serve, shared prefixes stick to one replica, and a replica whose
shard is killed is replaced while the other keeps serving."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from pathlib import Path

import httpx
import pytest
import ray
from tiny_models import hf_greedy
from transformers import AutoTokenizer

from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}: the quick brown fox" for i in range(8)]
NEW = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(ray_for_module, llama_dir):
    from tpserve.serve import app

    cfg = EngineConfig(
        model=ModelConfig(path=str(llama_dir), model_id="tiny", max_model_len=256),
        parallel=ParallelConfig(tp_size=2, device="cpu", cpus_per_shard=1),
        cache=CacheConfig(block_size=4, num_blocks=256, prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_concurrent_requests=64))
    # 4 logical CPUs: 4 shards of half a CPU, 2 replica actors of a quarter.
    spec = app.ReplicaSpec(num_replicas=2, shard_cpus=0.5, health_check_period_s=1.0)
    url = app.run(cfg, spec, "127.0.0.1", free_port())
    yield url
    app.shutdown()


def replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/info", timeout=30).json()["replicas"]


def wait_for(pred, timeout_s: float, what: str, show=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {show() if show else ''}")


async def generate_all(url: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(p):
            r = await client.post(f"{url}/generate", json={
                "inputs": p, "parameters": {"max_new_tokens": NEW, "details": True}})
            r.raise_for_status()
            return r.json()
        return await asyncio.gather(*[one(p) for p in prompts])


def served_tokens(url: str) -> dict[str, float]:
    return {r["replica_id"]: r.get("tokens_generated", 0.0) for r in replicas(url)}


def settled_tokens(url: str) -> dict[str, float]:
    """Tokens per replica once both replicas report and the counts stopped moving: the
    replicas' stats arrive about once a second, so a read right after other traffic would
    count that traffic as this test's."""
    last: dict[str, float] = {}

    def settled():
        nonlocal last
        now = served_tokens(url)
        done = len(now) == 2 and now == last
        last = now
        return now if done else None

    return wait_for(lambda: settled() or time.sleep(1.2), 60, "settled replica stats")


def test_replicas_match_transformers_and_share_load(serve_url, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    hf_ids = dict(zip(PROMPTS, hf_greedy(llama_dir, PROMPTS, NEW)))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    # app.run returns once Serve has both replicas up; /health says so once the ingress saw it.
    wait_for(lambda: httpx.get(f"{serve_url}/health", timeout=30).status_code == 200, 10,
             "/health 200")
    assert httpx.get(f"{serve_url}/health", timeout=30).json() == {
        "status": "ok", "replicas_ready": 2, "replicas_wanted": 2}
    out = asyncio.run(generate_all(serve_url, prompts))
    for p, r in zip(prompts, out):
        ids = [t["id"] for t in r["details"]["tokens"]]
        # Token-identical to transformers (ours may stop early at EOS; transformers' helper
        # generates all NEW tokens).
        assert ids == list(hf_ids[p][: len(ids)]), (p, ids, hf_ids[p])
        assert len(ids) == NEW or r["details"]["finish_reason"] == "eos_token"
        assert r["generated_text"] == tok.decode(ids, skip_special_tokens=True)
    # Routing stats reach the ingress about once a second: read them once they stopped
    # moving (a read as soon as both replicas report can miss the last second's tokens).
    served = settled_tokens(serve_url)
    assert all(served.values()), (served, httpx.get(f"{serve_url}/info").json())
    assert sum(served.values()) >= 32
    shards = [(r["namespace"], name) for r in replicas(serve_url) for name in r["shards"]]
    assert len(shards) == 4
    for namespace, name in shards:  # four shard actors alive
        assert ray.get(ray.get_actor(name, namespace=namespace).health.remote(), timeout=30)


def test_shared_prefix_lands_mostly_on_one_replica(serve_url):
    system = "You are a careful assistant who answers in one short sentence. " * 3
    prompts = [system + f"Question {i}?" for i in range(16)]
    # One request first, so a replica holds the prefix before the burst: Serve may route
    # several requests of a burst before the router has recorded where the first one went.
    asyncio.run(generate_all(serve_url, [system + "Question?"]))
    before = settled_tokens(serve_url)
    asyncio.run(generate_all(serve_url, prompts))
    after = settled_tokens(serve_url)
    delta = sorted(after[r] - before.get(r, 0.0) for r in after)
    assert delta[-1] >= 0.75 * sum(delta), delta


def test_killed_shard_replica_is_replaced_while_other_serves(serve_url):
    old = set(served_tokens(serve_url))
    victim = sorted(old)[0]
    info = {r["replica_id"]: r for r in replicas(serve_url)}[victim]
    ray.kill(ray.get_actor(info["shards"][1], namespace=info["namespace"]))
    t0 = time.monotonic()
    ok, health = 0, []
    while time.monotonic() - t0 < 8:  # the replica is being replaced meanwhile
        asyncio.run(generate_all(serve_url, PROMPTS[:2]))
        ok += 2
        h = httpx.get(f"{serve_url}/health", timeout=30)
        health.append((h.status_code, h.json().get("status")))
    assert ok >= 2
    # One replica serves throughout: /health stays 200, and says the other is missing.
    assert all(code == 200 for code, _ in health), health
    assert (200, "degraded") in health, health
    ids = wait_for(lambda: (lambda s: s if len(s) == 2 and victim not in s else None)(
        set(served_tokens(serve_url))), 240, "the replica to be replaced")
    new = (ids - old).pop()
    before = served_tokens(serve_url)
    asyncio.run(generate_all(serve_url, [f"fresh prompt {i}" for i in range(16)]))
    after = wait_for(lambda: (lambda s: s if s.get(new, 0) > before.get(new, 0) else None)(
        served_tokens(serve_url)), 30, "the new replica to serve")
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)
    wait_for(lambda: httpx.get(f"{serve_url}/health", timeout=30).json()["status"] == "ok",
             10, "/health ok again")
    # The new replica has its own two shards; the lost replica's surviving shard went with it.
    shards = [(r["namespace"], name) for r in replicas(serve_url) for name in r["shards"]]
    assert len(shards) == 4
    for namespace, name in shards:
        assert ray.get(ray.get_actor(name, namespace=namespace).health.remote(), timeout=30)
    survivor = info["shards"][0]
    wait_for(lambda: not actor_alive(survivor, info["namespace"]), 60,
             "the lost replica's other shard to be stopped")


def actor_alive(name: str, namespace: str) -> bool:
    try:
        ray.get(ray.get_actor(name, namespace=namespace).health.remote(), timeout=10)
        return True
    except Exception:  # noqa: BLE001 - gone, dead or unreachable all mean not serving
        return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("grpc_handles", ["0", "1"], ids=["actor-call-handles", "grpc-handles"])
def test_replicas_listen_on_loopback_only(llama_dir, tmp_path, grpc_handles):
    """`tpserve launch --replicas 2` on its own cluster, as a user runs it: tpserve.Client
    and TGI's client (plain and streamed) get transformers' output through the one address,
    /info lists two ready replicas, and no process of it listens beyond loopback. Each Serve
    replica (the ingress and both replicas) holds an inter-deployment gRPC server that Ray
    binds to every interface; tpserve binds it to loopback there (serve/loopback.py). With
    RAY_SERVE_USE_GRPC_BY_DEFAULT=1 the proxy's and the ingress's handles reach the replicas
    through that server, so the answers show it still works."""
    from server_process import launched_process, listening_sockets
    from test_rebuild_server import descendants
    from text_generation import Client as TGIClient

    import tpserve

    tok = AutoTokenizer.from_pretrained(llama_dir)
    want = tok.decode(hf_greedy(llama_dir, PROMPTS[:1], NEW)[0], skip_special_tokens=True)
    env = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": grpc_handles}
    with launched_process(["--model", str(llama_dir), "--replicas", "2", "--num-blocks", "256"],
                          tmp_path / "server.log", env=env) as (proc, url):
        for _ in range(4):  # both replicas answer (the router spreads them)
            r = httpx.post(url + "/generate", timeout=60, json={
                "inputs": PROMPTS[0], "parameters": {"max_new_tokens": NEW}})
            assert r.status_code == 200 and r.json()["generated_text"] == want, r.text
        ours = tpserve.Client(url, timeout=60).generate(PROMPTS[0], max_new_tokens=NEW)
        tgi = TGIClient(url, timeout=60).generate(PROMPTS[0], max_new_tokens=NEW)
        streamed = "".join(e.token.text for e in tpserve.Client(url, timeout=60)
                           .generate_stream(PROMPTS[0], max_new_tokens=NEW)
                           if not e.token.special)
        assert ours.generated_text == tgi.generated_text == streamed == want
        listed = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(replicas(url)), 30,
                          "two replicas listed")
        assert all(r["state"] == "ready" for r in listed)
        found = listening_sockets([proc.pid, *descendants(proc.pid)])
        titles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                  .replace("\0", " ").strip()[:120] for _, _, pid in found}
    port = int(url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in {(a, p) for a, p, _ in found}, found
    # Not vacuous: every Serve replica was seen with its two servers (its core worker's and
    # the inter-deployment one).
    serve_pids = [pid for pid, t in titles.items() if t.startswith("ray::ServeReplica:")]
    kinds = sorted(titles[pid].split()[0] for pid in serve_pids)
    assert kinds == ["ray::ServeReplica:tpserve:tpserve-ingress"] + [
        "ray::ServeReplica:tpserve:tpserve-replica"] * 2, titles
    held = [sum(1 for _, _, pid in found if pid == s) for s in serve_pids]
    assert held == [2, 2, 2], (held, found)
    exposed = [f"{a} port {p}: {titles[pid]}" for a, p, pid in found
               if not ipaddress.ip_address(a).is_loopback]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)
