"""A stand-in for a Serve DeploymentHandle over FakeBackend "replicas", with Serve's shape:
.options(stream=True).generate.remote(...) gives a stream with cancel(), errors come wrapped
like Ray's RayTaskError (the replica's exception as .cause), .broadcast() reaches every
replica. Replicas are picked in turn, as a router would. And a spy on the deployments an
application declares (spy_deployment_options)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from fake_backend import FakeBackend

from tpserve.errors import NotReadyError


class WrappedReplicaError(Exception):
    """What a DeploymentHandle raises for a replica's exception (RayTaskError-like)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"replica raised {type(cause).__name__}: {cause}\nTraceback ...")
        self.cause = cause


@dataclass
class FakeReplica:
    replica_id: str
    backend: FakeBackend = field(default_factory=FakeBackend)
    dead: bool = False
    stopped: bool = False  # its actor killed (Serve stopping): streams end in RayActorError
    served: int = 0

    def status(self) -> dict:
        return {"replica_id": self.replica_id, "ready": not self.dead,
                "dead": "a shard actor died" if self.dead else None,
                "shards": [f"tpserve-{self.replica_id}-shard-{r}" for r in range(2)],
                "namespace": "serve", "at": float(self.served),
                "stats": {"ready": float(not self.dead), "tokens_generated": 2.0 * self.served,
                          "kv_blocks_free": 10.0}}


class FakeStream:
    def __init__(self, replica: FakeReplica, args: tuple) -> None:
        self.replica, self.args = replica, args
        self.cancelled = False
        self._it = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.replica.stopped:
            import ray

            raise ray.exceptions.ActorDiedError()
        try:
            if self._it is None:
                if self.replica.dead:
                    raise NotReadyError("the engine failed: a shard actor died")
                self.replica.served += 1
                self._it = self.replica.backend.generate(*self.args)
            return [await self._it.__anext__()]  # a replica sends lists of events
        except StopAsyncIteration:
            raise
        except Exception as exc:  # noqa: BLE001 - wrapped as Serve wraps a replica's error
            raise WrappedReplicaError(exc) from None

    def cancel(self) -> None:
        self.cancelled = True
        if self._it is not None:
            asyncio.ensure_future(self._it.aclose())


class _Method:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args):
        replica = self.handle.pick()
        if self.name == "generate":
            stream = FakeStream(replica, args)
            self.handle.streams.append(stream)
            return stream

        async def call():
            return getattr(replica.backend, self.name)(*args)
        return call()


class _Broadcast:
    def __init__(self, replicas: list[FakeReplica], method: str) -> None:
        self.replicas, self.method = replicas, method

    async def results_async(self, timeout_s=None, return_exceptions=False):
        return [getattr(r, self.method)() for r in self.replicas]


class FakeHandle:
    def __init__(self, replicas: list[FakeReplica]) -> None:
        self.replicas = replicas
        self.streams: list[FakeStream] = []
        self._turn = itertools.count()

    def pick(self) -> FakeReplica:
        return self.replicas[next(self._turn) % len(self.replicas)]

    def options(self, **_):
        return self

    def broadcast(self, method: str) -> _Broadcast:
        return _Broadcast(self.replicas, method)

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


@dataclass
class OptionsCall:
    """One `.options(**opts)` call on a declared deployment, and the Deployment it returned."""
    opts: dict[str, Any]
    deployment: Any


def spy_deployment_options(monkeypatch) -> list[OptionsCall]:
    """Patch `serve.deployment` so every `.options(...)` on a deployment declared from now on
    is recorded, in order, in the list returned; the real Serve objects are still built."""
    from ray import serve

    calls: list[OptionsCall] = []
    real = serve.deployment

    def spy(cls=None, **kw):
        d = real(cls, **kw) if cls is not None else real(**kw)
        original = d.options

        def options(**opts):
            calls.append(OptionsCall(opts, original(**opts)))
            return calls[-1].deployment

        d.options = options
        return d

    monkeypatch.setattr(serve, "deployment", spy)
    return calls
