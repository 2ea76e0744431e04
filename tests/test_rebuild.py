"""A lost shard group is rebuilt: the retry policy, and AsyncEngine's lifecycle around it
(which requests fail, which are replayed, health and the budget) over a scripted engine."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fake_backend import serve

from tpserve.engine.async_engine import AsyncEngine, NullMetrics
from tpserve.engine.build_wait import report_wait, reporting_waits
from tpserve.engine.rebuild import RebuildPolicy
from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo
from tpserve.errors import NotReadyError, ShardLostError
from tpserve.executor.base import ShardFailedError
from tpserve.server.app import build_app


def test_policy_backs_off_doubling_per_outage_and_stops_at_the_budget():
    p = RebuildPolicy(max_rebuilds=4, backoff_s=1.0)
    assert p.next_delay() == 1.0
    p.record(ok=False)
    assert p.next_delay() == 2.0
    p.record(ok=False)
    assert p.next_delay() == 4.0
    p.record(ok=True)  # the outage is over: the next one starts from 1x again
    assert (p.attempts, p.rebuilds, p.left) == (3, 1, 1)
    assert p.next_delay() == 1.0
    p.record(ok=True)
    assert p.left == 0 and p.next_delay() is None


def test_policy_caps_the_wait_and_refuses_bad_values():
    p = RebuildPolicy(max_rebuilds=10, backoff_s=10.0, max_backoff_s=25.0)
    for _ in range(3):
        p.record(ok=False)
    assert p.next_delay() == 25.0
    assert RebuildPolicy(max_rebuilds=0).next_delay() is None
    with pytest.raises(ValueError, match="--max-rebuilds"):
        RebuildPolicy(max_rebuilds=-1)
    with pytest.raises(ValueError, match="--rebuild-backoff"):
        RebuildPolicy(backoff_s=-1.0)


class ScriptedEngine:
    """The Engine shape AsyncEngine uses; each request produces token ids 0, 1, 2...
    `lose()` makes the next step fail as a dead shard does. Independent of tpserve's engine,
    so the lifecycle is tested on its own."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.requests: dict[int, tuple[int, int]] = {}  # seq id -> (made, wanted)
        self.next_id = 0  # starts over in every new group, like a real one
        self.lost = threading.Event()
        self.killed = False
        self.stepped = threading.Event()
        # What AsyncEngine.info() reads.
        self.cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32", tokenizer_id=None),
                                   parallel=SimpleNamespace(device="cpu", tp_size=2,
                                                            placement="pack"),
                                   cache=SimpleNamespace(block_size=16),
                                   lora=SimpleNamespace(names=()))
        self.max_input_tokens, self.max_model_len, self.num_blocks = 8, 16, 4
        self.load_reports = [SimpleNamespace(backend="scripted")]
        self.hf_config = None

    def tokenize(self, prompt, truncate=None, add_special_tokens=True):
        return [1, 2, 3]

    def add_request(self, prompt_ids, params):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.requests[seq_id] = (0, params.max_new_tokens)
        return type("Seq", (), {"seq_id": seq_id, "params": params})()

    def abort(self, seq_id):
        self.requests.pop(seq_id, None)

    def has_work(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.01)
        if self.lost.is_set():
            raise ShardFailedError(f"shard 1 of group {self.generation} failed")
        events = []
        for seq_id, (made, wanted) in list(self.requests.items()):
            done = made + 1 == wanted
            events.append((seq_id, GenerationEvent(
                TokenInfo(made, str(made), 0.0), finished=done,
                generated_text=str(self.generation) if done else None)))
            if done:
                del self.requests[seq_id]
            else:
                self.requests[seq_id] = (made + 1, wanted)
        self.stepped.set()
        return events, None

    def stats(self):
        return {}

    def check(self):  # what CoreClient.check does while idle: raise if a rank is gone
        if self.lost.is_set():
            raise ShardFailedError(f"shard 1 of group {self.generation} is gone")

    def kill(self):
        self.killed = True

    def shutdown(self):
        self.killed = True


class CountingMetrics(NullMetrics):
    def __init__(self) -> None:
        self.rebuilds = 0

    def rebuilt(self) -> None:
        self.rebuilds += 1


@pytest.fixture
def lifecycle():
    built: list[ScriptedEngine] = []
    gate = threading.Event()  # a rebuild (not the first build) waits for it
    gate.set()

    def build():
        if built:
            assert gate.wait(10)
        built.append(ScriptedEngine(len(built)))
        return built[-1]

    metrics = CountingMetrics()
    backend = AsyncEngine(build, "scripted", 8, lambda stats: metrics,
                          RebuildPolicy(max_rebuilds=1, backoff_s=0.05))
    backend.start()
    backend.wait_ready(10)
    yield backend, built, gate, metrics
    backend.stop()


async def _collect(backend, n):
    return [e async for e in backend.generate("x", SamplingParams(max_new_tokens=n))]


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_lost_shard_fails_started_requests_replays_queued_ones_and_rebuilds(lifecycle):
    backend, built, gate, metrics = lifecycle

    async def scenario():
        long = asyncio.ensure_future(_collect(backend, 10_000))
        await asyncio.to_thread(_wait_for, built[0].stepped.is_set)
        gate.clear()  # hold the rebuild so the state in between can be seen
        built[0].lost.set()
        with pytest.raises(ShardLostError, match="shard 1 of group 0 failed.*rebuilding the "
                                                 "shard group, retry when GET /health"):
            await long
        assert not backend.ready() and backend.state == "rebuilding"
        assert "rebuilding the shard group (attempt 1 of 1)" in backend.not_ready_reason()
        with pytest.raises(NotReadyError, match="a shard was lost"):
            await _collect(backend, 2)
        # The whole old group is torn down before the new one is built (held by the gate).
        await asyncio.to_thread(_wait_for, lambda: built[0].killed)
        assert len(built) == 1
        gate.set()
        await asyncio.to_thread(_wait_for, backend.ready)
        events = await _collect(backend, 3)
        assert [e.token.id for e in events] == [0, 1, 2]
        assert events[-1].generated_text == "1"  # served by the rebuilt group

    asyncio.run(scenario())
    assert metrics.rebuilds == 1 and len(built) == 2
    extra = backend.info().extra
    assert (extra["replica_state"], extra["rebuilds"], extra["rebuilds_left"]) == ("serving", 1, 0)
    assert backend.stats()["rebuilds"] == 1.0


def test_request_that_got_no_token_is_served_by_the_rebuilt_group(lifecycle):
    backend, built, gate, _ = lifecycle

    async def scenario():
        gate.clear()
        built[0].lost.set()  # the next step fails before the request's first token
        waiting = asyncio.ensure_future(_collect(backend, 3))
        await asyncio.to_thread(_wait_for, lambda: backend.state == "rebuilding")
        gate.set()
        events = await waiting
        return events

    events = asyncio.run(scenario())
    assert [e.token.id for e in events] == [0, 1, 2] and events[-1].generated_text == "1"


def test_budget_spent_leaves_a_server_that_answers_503_with_the_reason(lifecycle):
    backend, built, _, metrics = lifecycle

    async def lose_once(then: str):
        long = asyncio.ensure_future(_collect(backend, 10_000))
        await asyncio.to_thread(_wait_for, built[-1].stepped.is_set)
        built[-1].lost.set()
        with pytest.raises(ShardLostError, match=then):
            await long

    asyncio.run(lose_once("the server is rebuilding the shard group"))
    _wait_for(backend.ready)
    # The budget is spent: no promise of a rebuild to retry against.
    asyncio.run(lose_once(r"no rebuild left \(--max-rebuilds\) and stops serving: restart"))
    _wait_for(lambda: backend.state == "failed")
    reason = backend.not_ready_reason()
    assert "1 of --max-rebuilds 1 attempts spent" in reason and "shard 1 of group 1" in reason
    with pytest.raises(NotReadyError, match="restart tpserve launch"):
        asyncio.run(_collect(backend, 2))
    assert built[1].killed and len(built) == 2 and metrics.rebuilds == 1
    assert backend.stats()["failed"] == 1.0


def test_failed_rebuild_attempts_count_and_back_off():
    calls: list[float] = []

    def build():
        calls.append(time.monotonic())
        if len(calls) > 1:
            raise RuntimeError("no node has room for the placement group")
        return ScriptedEngine(0)

    backend = AsyncEngine(build, "scripted", 8, None,
                          RebuildPolicy(max_rebuilds=2, backoff_s=0.1))
    backend.start()
    backend.wait_ready(10)
    try:
        async def lose():
            long = asyncio.ensure_future(_collect(backend, 10_000))
            await asyncio.to_thread(_wait_for, backend.engine.stepped.is_set)
            backend.engine.lost.set()
            with pytest.raises(ShardLostError):
                await long

        asyncio.run(lose())
        _wait_for(lambda: backend.state == "failed")
        assert len(calls) == 3 and calls[2] - calls[1] >= 0.2 - 0.01  # 0.1 s, then 0.2 s
        assert "no node has room" in backend.not_ready_reason()
    finally:
        backend.stop()


def test_loss_while_idle_is_noticed_without_a_request(lifecycle):
    backend, built, _, metrics = lifecycle
    built[0].lost.set()
    _wait_for(lambda: len(built) == 2 and backend.ready(), timeout=10)
    assert metrics.rebuilds == 1 and built[0].killed
    events = asyncio.run(_collect(backend, 2))
    assert [e.token.id for e in events] == [0, 1] and events[-1].generated_text == "1"


def test_request_that_outlives_its_deadline_during_a_rebuild_is_dropped_not_served(lifecycle):
    """A kept request whose caller gave up (--request-timeout, a disconnect) while the group
    was rebuilt is dropped from the replay: the new group never runs it."""
    backend, built, gate, _ = lifecycle

    async def scenario():
        gate.clear()
        built[0].lost.set()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_collect(backend, 3), timeout=0.5)
        assert backend.state == "rebuilding"
        gate.set()
        await asyncio.to_thread(_wait_for, backend.ready)

    asyncio.run(scenario())
    time.sleep(0.2)  # the engine thread has handled the abort and the replay
    assert not built[1].requests and built[1].next_id == 0


def test_a_failed_collective_counts_as_a_lost_shard_and_a_model_error_does_not():
    from torch.distributed import DistBackendError

    from tpserve.cluster.device import collective_failed

    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    hung = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms "
                        "for recv operation to complete")
    assert collective_failed(reset) and collective_failed(hung)
    assert collective_failed(DistBackendError("NCCL communicator was aborted"))
    assert not collective_failed(RuntimeError("shape mismatch in the attention kernel"))


def test_stop_during_a_rebuild_returns_at_once_and_the_late_group_is_shut_down(lifecycle):
    """Ctrl-C while a rebuild waits (for a placement: up to 120 s on a joined cluster, or
    for weights) took 30 s, the engine thread's join; the group built after the stop was
    left running."""
    backend, built, gate, _ = lifecycle
    gate.clear()  # the rebuild blocks in its build
    built[0].lost.set()
    _wait_for(lambda: backend.state == "rebuilding")
    time.sleep(0.3)  # past the 0.05 s back-off: in the build
    t0 = time.monotonic()
    backend.stop()
    assert time.monotonic() - t0 < 3
    gate.set()  # the build ends after the stop
    _wait_for(lambda: len(built) == 2)
    _wait_for(lambda: built[1].killed)
    assert backend.engine is built[0] and not backend.ready()


def test_stop_during_the_first_load_returns_at_once_and_wait_ready_ends():
    entered, release = threading.Event(), threading.Event()
    built: list[ScriptedEngine] = []

    def build():
        entered.set()
        assert release.wait(10)
        built.append(ScriptedEngine(0))
        return built[-1]

    backend = AsyncEngine(build, "scripted", 8, None)
    backend.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    backend.stop()
    assert time.monotonic() - t0 < 3
    release.set()
    with pytest.raises(NotReadyError, match="stopped before the model was ready"):
        backend.wait_ready(10)
    assert built[0].killed


def test_health_says_when_a_rebuild_waits_for_cluster_resources():
    """A rebuild whose placement waits (the node died, no other has room) answered only
    "rebuilding ..., retry shortly": nothing said it waited for resources, nor for which.
    Now /health carries what the placement reported, until the wait ends."""
    waiting, release = threading.Event(), threading.Event()
    built: list[ScriptedEngine] = []

    def build():
        if built:  # the rebuild: its placement waits, as place_shards reports it
            report_wait("waiting for cluster resources: Ray cannot place 2 shard(s) of 1 GPU")
            waiting.set()
            assert release.wait(10)
            report_wait(None)
        built.append(ScriptedEngine(len(built)))
        return built[-1]

    backend = AsyncEngine(build, "scripted", 8, None, RebuildPolicy(max_rebuilds=1,
                                                                    backoff_s=0.05))
    backend.start()
    backend.wait_ready(10)
    try:
        built[0].lost.set()
        assert waiting.wait(10)
        with serve(build_app(backend)) as url:
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["error_type"] == "unhealthy", body
            assert "rebuilding the shard group (attempt 1 of 1): waiting for cluster " \
                   "resources: Ray cannot place 2 shard(s) of 1 GPU" in body["error"], body
            release.set()
            _wait_for(backend.ready)
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert backend.waiting is None
    finally:
        release.set()
        backend.stop()


def test_the_wait_report_reaches_only_the_thread_that_installed_it():
    seen: list = []
    report_wait("nobody listens")  # outside any build: a no-op
    with reporting_waits(seen.append):
        report_wait("a")
        other = threading.Thread(target=report_wait, args=("another engine's",))
        other.start()
        other.join()
    assert seen == ["a", None]  # None: the build ended, whatever it last said
