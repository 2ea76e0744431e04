"""The driver's handle on a replica whose engine core runs in rank 0's actor.

It has the shape of tpserve.engine.engine.Engine as AsyncEngine uses it (tokenize,
add_request, abort, has_work, step, stats), so the HTTP bridge is the same for both: here
tokenization, detokenization and stop strings (the output processor) stay in the driver,
and step() is one long poll that returns every token the core produced since the last one.
The followers' step loops are watched too, so a dead rank fails in-flight requests even
when rank 0 is stuck in a collective with it.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpserve import errors
from tpserve.cluster.engine_core_actor import EngineCoreActor
from tpserve.cluster.follower import FollowerActor
from tpserve.cluster.placement import group_name, place_shards, ray_bundle, shard_names
from tpserve.config import EngineConfig
from tpserve.engine.core import eos_token_ids
from tpserve.engine.engine import tokenize
from tpserve.engine.guided import DriverGrammars
from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.request import GuidedSpec, SamplingParams
from tpserve.executor.base import ShardFailedError
from tpserve.hf_config import ConfigData
from tpserve.startup import shard_startup

log = logging.getLogger(__name__)

POLL_S = 0.05  # a poll returns at once when tokens are ready; this bounds an idle wait
# After an abort leaves the driver with nothing to run, it keeps polling (without waiting
# for tokens) until the core reports the aborted sequences gone, at most this long: the
# gauges (running sequences, KV blocks, work tokens, which the replica router reads) would
# otherwise keep the last step's values until the next request.
SETTLE_S = 2.0
# A rank that is alive but silent (its process stopped, or wedged outside Python) is no
# death Ray reports: rank 0 would wait in a collective with it for --collective-timeout
# (600 s by default). When the core's step count has not moved for STALL_S while requests
# wait, every rank is asked for health(); one that does not answer within
# STALL_HEALTH_TIMEOUT_S counts as lost. (Each actor answers health() from a thread of its
# own, so a rank busy in a long step still answers.)
STALL_S = 30.0
STALL_HEALTH_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = 30.0  # rank 0 silent this long while idle counts as lost


class CoreStepError(RuntimeError):
    def __init__(self, message: str, replica_dead: bool) -> None:
        super().__init__(message)
        self.replica_dead = replica_dead


def _settle(ref, wait_s: float = 0.0) -> None:
    """Fetch a call whose outcome is already reported (by start(), or by the error that
    killed the shards), so Ray does not log its error again as unhandled."""
    try:
        ray.get(ref, timeout=wait_s)
    except Exception:  # noqa: BLE001 - reported elsewhere
        pass


def _idle(stats: dict) -> bool:
    return not stats.get("running_sequences") and not stats.get("waiting_sequences")


class CoreClient:
    def __init__(self, cfg: EngineConfig, namespace: str | None = None) -> None:
        self.cfg = cfg
        # The shard actors are placed first: each starts its process, imports and reads the
        # config while this process imports transformers (and torch, for the check below)
        # and reads the config and the tokenizer: seconds each, which used to come before
        # the placement and so added to every launch.
        placed = time.time()
        self._place(cfg, namespace or ray.get_runtime_context().namespace)
        # The shards set up (weights, KV cache, warmup, graphs) while this process loads
        # the tokenizer; start() below waits for that and reports its errors.
        prepared = self.core.prepare.remote(self.followers)
        try:
            if cfg.model.hf_snapshot:
                # The launcher read and checked the config before Ray started (a rebuild and
                # a Ray Serve replica get the same snapshot): no second check, no torch here.
                self.hf_config = ConfigData(cfg.model.hf_snapshot)
            else:  # built by other code (the Python API): read and check it here
                from tpserve.weights import load_hf_config
                from tpserve.worker.build import check_shardable

                self.hf_config = load_hf_config(cfg.model.path)
                check_shardable(cfg, self.hf_config)
        except BaseException:
            self.kill()  # the shards may be setting up; no step loop runs yet
            _settle(prepared, wait_s=2.0)
            raise
        try:
            from tpserve.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.model.tokenizer_path, cfg.model.path)
        except Exception as exc:  # noqa: BLE001 - say which file is missing
            self.kill()
            _settle(prepared, wait_s=2.0)
            raise errors.CheckpointError("cannot load a tokenizer from "
                                         f"{cfg.model.tokenizer_path}: "
                                         f"{exc}") from exc
        special = frozenset(self.tokenizer.all_special_ids)
        self.output = OutputProcessor(self.tokenizer, special)
        eos = sorted(eos_token_ids(cfg.model.path, self.hf_config, self.tokenizer))
        # Guided requests: grammars are checked here and matched in the core, which gets
        # the vocabulary with the first such request (nothing is serialized before).
        self.grammars = DriverGrammars(self.tokenizer, getattr(self.hf_config, "vocab_size",
                                                               None), eos)
        self._vocab_sent = False
        try:
            info = ray.get(self.core.start.remote(eos, self.followers))
        except ray.exceptions.RayTaskError as exc:
            _settle(prepared)
            self.shutdown()
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, BaseException) else exc) from None
        except BaseException:
            self.shutdown()
            raise
        _settle(prepared)
        self.num_blocks = info["num_blocks"]
        self.load_reports = info["load_reports"]
        self.warmup_seconds = info["warmup_seconds"]
        self.max_input_tokens = info["max_input_tokens"]
        self.max_model_len = info["max_model_len"]
        self.loops = info["loops"]
        self.placed_at = placed
        self.startup = shard_startup(placed, info["marks"])
        self.executor = self  # health() for the driver, as Engine.executor.health()
        self._stats: dict[str, float] = info.get("stats", {})  # until the first poll
        self._settle_until = 0.0  # an abort not yet seen in the core's gauges (SETTLE_S)
        self._steps_seen, self._progress_at = -1.0, time.monotonic()  # STALL_S
        # The driver's share of serving (gauges, cumulative): seconds waiting in the poll
        # for the core's tokens, and seconds turning them into events (detokenization, stop
        # strings). A benchmark takes differences across a burst.
        self.poll_wait_seconds = 0.0
        self.process_seconds = 0.0

    def _place(self, cfg: EngineConfig, namespace: str) -> None:
        tp, device = cfg.parallel.tp_size, cfg.parallel.device
        self.names = shard_names(tp, namespace)
        self.pg = place_shards(ray_bundle(device, cfg.parallel.cpus_per_shard), tp,
                               bool(cfg.parallel.ray_address), placement=cfg.parallel.placement,
                               name=group_name(self.names))
        self.owns_pg = True  # kill() removes it (a rebuild places a new one)
        cpus = cfg.parallel.cpus_per_shard if device == "cpu" else 1

        def opts(rank: int, concurrency: int) -> dict:
            return dict(name=self.names[rank], namespace=namespace, num_cpus=cpus,
                        num_gpus=1 if device != "cpu" else 0, max_concurrency=concurrency,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=rank))

        # Rank 0: the step loop, submit_many/abort and the long poll, health, shutdown; it
        # gets the followers' handles with start(). Followers: 2 threads, so health()
        # answers while follow() runs. Neither class brings torch into this process.
        self.core = ray.remote(EngineCoreActor).options(**opts(0, 8)).remote(cfg)
        self.followers = [ray.remote(FollowerActor).options(**opts(r, 2)).remote(cfg, r)
                          for r in range(1, tp)]
        self.actors = [self.core, *self.followers]

    # --- the Engine shape AsyncEngine uses ------------------------------------------------
    def tokenize(self, prompt: str | list[int], truncate: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        return tokenize(self.tokenizer, prompt, truncate, add_special_tokens,
                        getattr(self.hf_config, "vocab_size", None))

    def add_request(self, prompt_ids: list[int], params: SamplingParams):
        got = self.add_requests([(prompt_ids, params)])[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def check_grammar(self, spec: GuidedSpec) -> None:
        """Compile a guided request's grammar here first (the driver calls this off its
        event loop), so one that does not compile is refused before it reaches the core."""
        self.grammars.check(spec)

    def add_requests(self, requests: list[tuple[list[int], SamplingParams]]) -> list:
        """Every request in one call, which the core answers at its next step boundary;
        each one's handle (seq_id, params with the seed filled in) or the error refusing it."""
        self._check_followers()
        if not self._vocab_sent and any(p.guided is not None for _, p in requests):
            # Once per core; the core builds the library's tokenizer in this call's thread,
            # not in its step loop.
            ray.get(self.core.set_guided_vocab.remote(self.grammars.get().vocab),
                    timeout=self.cfg.parallel.dist_timeout_s)
            self._vocab_sent = True
        try:
            # The core answers between steps; a step never outlasts the collective timeout.
            answers = ray.get(self.core.submit_many.remote(requests),
                              timeout=self.cfg.parallel.dist_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ShardFailedError("the engine core did not take requests within the "
                                   "collective timeout; the replica is stuck") from None
        out: list = []
        for answer in answers:
            if answer[0] == "error":
                cls = getattr(errors, answer[1], errors.ValidationError)
                out.append(cls(answer[2]))
                continue
            _, seq_id, params = answer
            self.output.add(seq_id, params)
            out.append(SimpleNamespace(seq_id=seq_id, params=params))
        return out

    def abort(self, seq_id: int) -> None:
        self.output.remove(seq_id)
        self.core.abort.remote([seq_id])
        self._settle_until = time.monotonic() + SETTLE_S

    def has_work(self) -> bool:
        """Requests to serve, or an abort whose effect the gauges do not show yet."""
        return bool(self.output.requests) or self._settle_until > 0.0

    def step(self):
        """One long poll: (seq_id, event) for every token since the last poll."""
        self._check_followers()
        t0 = time.perf_counter()
        outputs, self._stats, err = ray.get(self.core.poll.remote(POLL_S),
                                            timeout=POLL_S + self.cfg.parallel.dist_timeout_s)
        t1 = time.perf_counter()
        self.poll_wait_seconds += t1 - t0
        if err is not None:
            self.output.requests.clear()  # the core dropped them
            raise CoreStepError(f"{err[0]}: {err[1]}", err[2])
        self._check_progress(t1)
        events, stopped = self.output.process_packed(outputs)
        if stopped:
            self.core.abort.remote(stopped)  # a stop string: the core frees the blocks
            self._settle_until = time.monotonic() + SETTLE_S
        if self._settle_until and not self.output.requests and (
                _idle(self._stats) or time.monotonic() > self._settle_until):
            self._settle_until = 0.0
        self.process_seconds += time.perf_counter() - t1
        return events, None

    def _check_followers(self) -> None:
        """A follower whose step loop ended (dead actor, failed collective) fails the
        replica at once, even while rank 0 waits in a collective for it."""
        if self.loops:
            done, _ = ray.wait(self.loops, num_returns=1, timeout=0)
            if done:
                rank = 1 + self.loops.index(done[0])
                try:
                    ray.get(done[0])
                    why = "its step loop ended"
                except ray.exceptions.OwnerDiedError:
                    # Rank 0 started the loops: their owner died, so rank 0 is the lost one.
                    raise ShardFailedError(f"shard 0 ({self.names[0]}, the engine core) "
                                           "failed: its process exited") from None
                except Exception as exc:  # noqa: BLE001 - reported with the rank
                    why = f"{type(exc).__name__}: {exc}"
                raise ShardFailedError(f"shard {rank} ({self.names[rank]}) failed: {why}")

    def _check_progress(self, now: float) -> None:
        """Raise ShardFailedError when requests wait, no step has ended for STALL_S, and a
        rank does not answer health() (see STALL_S)."""
        steps = self._stats.get("steps", -1.0)
        if steps != self._steps_seen or not self.output.requests:
            self._steps_seen, self._progress_at = steps, now
            return
        if now - self._progress_at < STALL_S:
            return
        self._progress_at = now  # next check after another STALL_S at the earliest
        refs = [a.health.remote() for a in self.actors]
        _, silent = ray.wait(refs, num_returns=len(refs), timeout=STALL_HEALTH_TIMEOUT_S)
        if silent:
            rank = refs.index(silent[0])
            raise ShardFailedError(
                f"shard {rank} ({self.names[rank]}) stopped answering: no step ended for "
                f"{STALL_S + STALL_HEALTH_TIMEOUT_S:.0f}s and it did not answer a health "
                f"check in {STALL_HEALTH_TIMEOUT_S:.0f}s (its process is stopped or wedged)")

    def check(self) -> None:
        """Raise if a rank is gone (AsyncEngine calls this while idle): a follower's ended
        step loop, or rank 0 not answering (its actor is threaded, so it answers even
        mid-step)."""
        self._check_followers()
        ray.get(self.core.health.remote(), timeout=CHECK_TIMEOUT_S)

    def stats(self) -> dict[str, float]:
        return {**self._stats, "driver_poll_wait_seconds": self.poll_wait_seconds,
                "driver_process_seconds": self.process_seconds}

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        return ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)

    def shutdown(self) -> None:
        try:
            ray.get(self.core.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - tearing down; a dead actor needs no shutdown
            pass
        self.kill()

    def kill(self) -> None:
        """Tear the group down at once (after a lost shard: the live ranks may be stuck in a
        collective with the dead one, so they are not asked to stop first)."""
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if getattr(self, "owns_pg", False):  # a subclass placing into another's group keeps it
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
