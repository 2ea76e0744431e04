"""Replicas on Ray Serve, as a client sees a failure: a replica actor that dies while it
streams (its process killed, its node lost) is a lost shard group, answered as the direct
server answers one (503 `shard_lost`, retry), not an internal error."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import ray.exceptions
from fake_backend import serve
from serve_fakes import FakeHandle, FakeReplica, FakeStream, spy_deployment_options
from test_serve_ingress import WordTokenizer, make_backend

from tpserve.errors import ShardLostError
from tpserve.serve.ingress import ReplicaSetBackend, unwrap_replica_error
from tpserve.server.app import build_app


class DiesAfterFirstToken(FakeStream):
    """What a DeploymentHandle stream does when the replica's actor dies mid-request."""

    async def __anext__(self):
        if self._it is not None:
            raise ray.exceptions.ActorDiedError()
        return await super().__anext__()


def test_replica_actor_lost_mid_stream_is_503_shard_lost(monkeypatch):
    import serve_fakes

    monkeypatch.setattr(serve_fakes, "FakeStream", DiesAfterFirstToken)
    backend, handle = make_backend(2)
    with serve(build_app(backend)) as url:
        r = httpx.post(url + "/generate_stream", timeout=10,
                       json={"inputs": "a b c", "parameters": {"max_new_tokens": 5}})
        events = [json.loads(e[5:]) for e in r.text.split("\n\n") if e.startswith("data:")]
        assert "token" in events[0]
        assert events[-1]["error_type"] == "shard_lost", events[-1]
        assert "internal error" not in events[-1]["error"]
        assert "replica" in events[-1]["error"] and "retry" in events[-1]["error"]
        r = httpx.post(url + "/generate", timeout=10,
                       json={"inputs": "a b c", "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 503 and r.json()["error_type"] == "shard_lost", r.text


def test_health_waits_for_every_replica_then_says_degraded_while_one_is_replaced():
    """`--replicas 2`: /health answered 200 as soon as the first replica had loaded, so a load
    balancer or a start-up script sent full load to half the capacity. Now: 503 with the
    counts until both are ready; afterwards 200 while any serves, `degraded` below 2."""
    handle = FakeHandle([FakeReplica("r0")])  # r1 still loading: Serve does not run it yet
    backend = ReplicaSetBackend(handle, WordTokenizer(), replicas=2)
    asyncio.run(backend.refresh_info())
    asyncio.run(backend.refresh_replicas())

    def health() -> tuple[int, dict | None]:
        asyncio.run(backend.refresh_replicas())  # what the ingress's poller does each second
        r = httpx.get(url + "/health", timeout=5)
        return r.status_code, r.json() if r.content else None

    with serve(build_app(backend)) as url:
        status, body = health()
        assert status == 503, body
        assert body["error_type"] == "unhealthy" and "1 of 2 replicas ready" in body["error"]
        assert (body["replicas_ready"], body["replicas_wanted"]) == (1, 2)
        # Requests are served meanwhile (by the ready replica); only /health waits.
        r = httpx.post(url + "/generate", json={"inputs": "a b"}, timeout=10)
        assert r.status_code == 200, r.text

        handle.replicas.append(FakeReplica("r1"))  # r1 loaded
        assert health() == (200, {"status": "ok", "replicas_ready": 2, "replicas_wanted": 2})
        head = httpx.head(url + "/health", timeout=5)
        assert head.status_code == 200 and head.content == b""

        handle.replicas[1].dead = True  # r1's shard died: Serve is replacing it
        assert health() == (200, {"status": "degraded", "replicas_ready": 1,
                                  "replicas_wanted": 2})
        handle.replicas.pop()  # r1's actor stopped, its replacement is loading
        assert health() == (200, {"status": "degraded", "replicas_ready": 1,
                                  "replicas_wanted": 2})
        handle.replicas[0].dead = True  # none left
        status, body = health()
        assert status == 503 and body["error_type"] == "unhealthy", body
        assert "no replica can serve" in body["error"] and body["replicas_ready"] == 0
        handle.replicas[:] = [FakeReplica("r2"), FakeReplica("r3")]  # both replaced
        assert health() == (200, {"status": "ok", "replicas_ready": 2, "replicas_wanted": 2})


def test_health_waits_for_the_replicas_asked_for():
    from tpserve.serve.app import ReplicaSpec

    assert ReplicaSpec(num_replicas=3).replicas_wanted == 3
    assert ReplicaSpec(num_replicas=3, min_replicas=2, max_replicas=4).replicas_wanted == 2
    assert ReplicaSpec(num_replicas=3, max_replicas=4).replicas_wanted == 1


def test_unwrap_maps_every_lost_actor_error_and_keeps_others_as_500():
    for exc in (ray.exceptions.ActorDiedError(), ray.exceptions.ActorUnavailableError(
            "unavailable", b"\0" * 16), ray.exceptions.RayActorError()):
        err = unwrap_replica_error(exc)
        assert isinstance(err, ShardLostError) and err.status_code == 503, (exc, err)
    err = unwrap_replica_error(RuntimeError("boom"))
    assert not isinstance(err, ShardLostError) and err.status_code == 500


def _stream_in_thread(url: str, n: int, out: dict) -> threading.Thread:
    def run():
        r = httpx.post(url + "/generate_stream", timeout=30,
                       json={"inputs": "a b c", "parameters": {"max_new_tokens": n}})
        out["events"] = [json.loads(e[5:]) for e in r.text.split("\n\n")
                         if e.startswith("data:")]
    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_drain_lets_in_flight_streams_finish_and_refuses_new_requests_with_503():
    """What `tpserve launch --replicas R` does on SIGINT/SIGTERM before stopping Serve (which
    cut the streams after 10 s and sent new requests a 404 from Serve's proxy)."""
    backend, handle = make_backend(2)
    for r in handle.replicas:
        r.backend.token_delay = 0.05
    with serve(build_app(backend)) as url:
        out: dict = {}
        t = _stream_in_thread(url, 16, out)  # ~0.8 s
        _wait_for(lambda: backend.inflight == 1)
        t0 = time.monotonic()
        assert asyncio.run(backend.drain(10.0)) == 0
        assert time.monotonic() - t0 > 0.2  # it waited for the stream
        t.join()
        assert len(out["events"]) == 16 and out["events"][-1]["details"] is None
        assert all("error" not in e for e in out["events"])
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and "shutting down" in h.json()["error"]
        r = httpx.post(url + "/generate", json={"inputs": "a b"}, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"], r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503, r.text
        assert backend.inflight == 0


def test_drain_gives_up_after_its_timeout_and_says_how_many_are_left():
    backend, handle = make_backend(1)
    handle.replicas[0].backend.token_delay = 0.05
    with serve(build_app(backend)) as url:
        out: dict = {}
        t = _stream_in_thread(url, 60, out)  # ~3 s
        _wait_for(lambda: backend.inflight == 1)
        assert asyncio.run(backend.drain(0.2)) == 1
        t.join()
    assert backend.inflight == 0


def test_a_stream_the_stop_cuts_ends_with_503_unhealthy():
    """--shutdown-timeout ran out (or a second Ctrl-C): Serve stops the replicas with a
    stream in flight. The stream ends with the direct server's error event, 503
    `unhealthy` (it was a 500 `generation`, which reads as an engine failure)."""
    backend, handle = make_backend(1)
    handle.replicas[0].backend.token_delay = 0.05
    with serve(build_app(backend)) as url:
        out: dict = {}
        t = _stream_in_thread(url, 60, out)  # ~3 s
        _wait_for(lambda: handle.replicas[0].served == 1)  # the replica is generating
        assert asyncio.run(backend.drain(0.2)) == 1
        handle.replicas[0].stopped = True
        t.join()
    assert len(out["events"]) > 1, out  # tokens, then the error
    last = out["events"][-1]
    assert last["error_type"] == "unhealthy", out["events"]
    assert last["error"].startswith("the server shut down before this request finished")
    assert backend.inflight == 0


def test_replica_deployment_logs_no_access_line_per_status_poll(monkeypatch):
    """The ingress asks every replica for status() each second: with Serve's access log on
    the replicas, `tpserve launch --replicas 2` printed 2 `CALL status OK` lines a second."""
    from ray.serve.schema import LoggingConfig
    from test_serve_cli import config

    from tpserve.serve import app

    calls = spy_deployment_options(monkeypatch)
    app.build_application(config(2, "cpu"), app.ReplicaSpec(num_replicas=2))
    by_name = {c.deployment.name: c.deployment for c in calls}
    replica_log = LoggingConfig(**by_name[app.REPLICA_DEPLOYMENT].logging_config)
    assert replica_log.enable_access_log is False
    ingress_log = by_name[app.INGRESS_DEPLOYMENT].logging_config
    assert ingress_log is None or LoggingConfig(**ingress_log).enable_access_log


def test_second_replicas_launch_on_a_cluster_refuses_instead_of_replacing_the_first(
        monkeypatch):
    """`tpserve launch --replicas 2 --address X` twice: serve.run would redeploy the same
    application name over the first deployment, and the second one's Ctrl-C (serve.shutdown)
    would stop the first as well."""
    from types import SimpleNamespace

    import pytest
    from ray import serve
    from test_serve_cli import config

    from tpserve.serve import app

    called = []
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(
        applications={app.APP_NAME: object()}))
    monkeypatch.setattr(serve, "start", lambda **kw: called.append("start"))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: called.append("run"))
    with pytest.raises(app.AppExistsError, match="already runs a tpserve deployment"):
        app.run(config(2, "cpu"), app.ReplicaSpec(num_replicas=2), "127.0.0.1", 8000)
    assert called == []
    # With no such application, it deploys.
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    monkeypatch.setattr(app, "build_application", lambda *a, **kw: "bound app")
    assert app.run(config(2, "cpu"), app.ReplicaSpec(num_replicas=2), "127.0.0.1",
                   8000) == "http://127.0.0.1:8000"
    assert called == ["start", "run"]


def test_refused_second_launch_leaves_the_first_deployment_running(monkeypatch, capsys):
    """The refusing launcher exits 1 without serve.shutdown() (which would stop the Serve
    instance, and the first deployment with it)."""
    from types import SimpleNamespace

    import ray
    from test_serve_cli import config, parse

    from tpserve import cli
    from tpserve.serve import app

    def refuse(*a, **kw):
        raise app.AppExistsError("this Ray cluster already runs a tpserve deployment")

    stopped = []
    monkeypatch.setattr(cli, "_start_ray", lambda *a, **kw: None)
    monkeypatch.setattr(app, "run", refuse)
    # No cluster here: the fit check would read whatever Ray an earlier test left connected
    # (alone, none: "Ray has not been started yet").
    monkeypatch.setattr(app, "check_replicas_fit", lambda *a, **kw: None)
    monkeypatch.setattr(app, "shutdown", lambda: stopped.append("serve"))
    monkeypatch.setattr(ray, "shutdown", lambda **kw: stopped.append("ray"))
    args = parse("--replicas", "2", "--address", "auto")
    assert cli.launch_replicas(args, config(2, "cpu"), SimpleNamespace(ssl_certfile=None)) == 1
    assert stopped == ["ray"]  # disconnected, Serve left alone
    out = capsys.readouterr()
    assert "already runs a tpserve deployment" in out.err
    assert out.out.splitlines()[-1] == ("tpserve: stopped (the Ray cluster at --address auto "
                                        "keeps running)")
    # Any other start-up failure still tears down what this launch started.
    monkeypatch.setattr(app, "run", lambda *a, **kw: 1 / 0)
    stopped.clear()
    assert cli.launch_replicas(args, config(2, "cpu"), SimpleNamespace(ssl_certfile=None)) == 1
    assert stopped == ["serve", "ray"]
