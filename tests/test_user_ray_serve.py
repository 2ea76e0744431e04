"""Replicas on Ray Serve, as a client sees a failure: a replica actor that dies while it
streams (its process killed, its node lost) is a lost shard group, answered as the direct
server answers one (503 `shard_lost`, retry), not an internal error."""

from __future__ import annotations

import json

import httpx
import ray.exceptions
from fake_backend import serve
from serve_fakes import FakeStream
from test_serve_ingress import make_backend

from tpserve.errors import ShardLostError
from tpserve.serve.ingress import unwrap_replica_error
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


def test_unwrap_maps_every_lost_actor_error_and_keeps_others_as_500():
    for exc in (ray.exceptions.ActorDiedError(), ray.exceptions.ActorUnavailableError(
            "unavailable", b"\0" * 16), ray.exceptions.RayActorError()):
        err = unwrap_replica_error(exc)
        assert isinstance(err, ShardLostError) and err.status_code == 503, (exc, err)
    err = unwrap_replica_error(RuntimeError("boom"))
    assert not isinstance(err, ShardLostError) and err.status_code == 500
