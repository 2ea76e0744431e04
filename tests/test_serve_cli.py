"""`--replicas`, `--min-replicas`, `--max-replicas`: parsing, presets, which server they pick,
and the Serve deployment options they become (no Ray cluster needed)."""

from __future__ import annotations

import pytest
from serve_fakes import spy_deployment_options

from tpserve import cli
from tpserve.config import EngineConfig, ModelConfig, ParallelConfig


def config(tp: int, device: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="/models/m", model_id="m"),
                        parallel=ParallelConfig(tp_size=tp, device=device))


def parse(*argv: str):
    return cli.apply_preset(cli.build_parser(), ["launch", *argv])


def test_replicas_flags_pick_serve_and_one_replica_keeps_the_direct_server():
    assert not cli.uses_serve(parse())
    assert not cli.uses_serve(parse("--replicas", "1"))
    assert cli.uses_serve(parse("--replicas", "2"))
    assert cli.uses_serve(parse("--replicas", "auto"))
    assert cli.uses_serve(parse("--min-replicas", "1", "--max-replicas", "3"))


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_bad_replica_counts_are_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--replicas", bad)
    assert "--replicas takes a count >= 1 or auto" in capsys.readouterr().err


def test_min_above_max_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="--min-replicas 3 is above --max-replicas 2"):
        cli._check_replica_flags(parse("--min-replicas", "3", "--max-replicas", "2"))  # noqa: SLF001


def test_replica_keys_in_a_preset(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("tp: 2\nreplicas: auto\nmax-replicas: 4\n")
    args = parse("--config", str(preset))
    assert (args.tp, args.replicas, args.max_replicas) == (2, "auto", 4)
    assert parse("--config", str(preset), "--replicas", "3").replicas == "3"


def test_deployment_options_reserve_a_bundle_per_shard_and_autoscale(monkeypatch):
    from tpserve.serve import app

    cfg = config(4, "cuda")
    calls = spy_deployment_options(monkeypatch)
    app.build_application(cfg, app.ReplicaSpec(num_replicas=2, min_replicas=1,
                                                max_replicas=3))
    replica = next(c.opts for c in calls if c.opts["name"] == app.REPLICA_DEPLOYMENT)
    bundles = replica["placement_group_bundles"]
    assert bundles[0] == {"CPU": app.REPLICA_CPUS}
    assert bundles[1:] == [{"GPU": 1.0, "CPU": 1.0}] * 4
    assert replica["autoscaling_config"]["min_replicas"] == 1
    assert replica["autoscaling_config"]["max_replicas"] == 3
    assert replica["autoscaling_config"]["initial_replicas"] == 2
    assert "num_replicas" not in replica
    assert "TPServeRequestRouter" in str(replica["request_router_config"].request_router_class)
    assert replica["health_check_period_s"] > 0


def test_auto_counts_whole_replicas_of_the_cluster(monkeypatch):
    from tpserve.serve import app

    monkeypatch.setattr(app.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    cfg = config(4, "cuda")
    assert app.replicas_that_fit(cfg) == 2  # 8 GPUs / 4 per replica
    cfg = config(3, "cuda")
    assert app.replicas_that_fit(cfg) == 2
    monkeypatch.setattr(app.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    with pytest.raises(RuntimeError, match="one replica needs"):
        app.replicas_that_fit(cfg)


def test_replicas_the_cluster_cannot_hold_are_named_before_serve_waits(monkeypatch):
    """Serve waits without end for replicas that cannot be placed (it logs every 30 s that
    one is not scheduled): the launch says what is missing first."""
    from tpserve.serve import app

    monkeypatch.setattr(app.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 6.0})
    cfg = config(4, "cuda")
    app.check_replicas_fit(cfg, 1)
    with pytest.raises(RuntimeError) as info:
        app.check_replicas_fit(cfg, 2)
    msg = str(info.value)
    assert "2 replica(s) of tp=4 need 4.25 CPU, 4 GPU each" in msg, msg
    assert "the cluster has 16 CPU, 6 GPU in all: it holds 1" in msg and "--replicas" in msg


def test_a_stop_ends_the_wait_for_the_replicas():
    """serve.run blocks until every replica has loaded and Ctrl-C did not end it: it runs in
    a thread, and a stop returns at once."""
    import threading
    import time

    stop, release = threading.Event(), threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    t0 = time.monotonic()
    assert cli._until_ready(lambda: release.wait(30), stop) is None
    assert time.monotonic() - t0 < 3
    release.set()
    assert cli._until_ready(lambda: "http://127.0.0.1:1", threading.Event()) == \
        "http://127.0.0.1:1"
    with pytest.raises(RuntimeError, match="deploy failed"):
        cli._until_ready(lambda: (_ for _ in ()).throw(RuntimeError("deploy failed")),
                         threading.Event())
