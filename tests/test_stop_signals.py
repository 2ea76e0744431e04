"""`tpserve launch` called in-process (tpserve.cli.main from a program or a notebook) hears
Ctrl-C while it runs and gives the caller's SIGINT and SIGTERM handlers back on return; off
the main thread it runs without them. No Ray cluster: Ray's calls are stubbed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import ray
from test_serve_cli import config, parse

from tpserve import cli
from tpserve.serve import app
from tpserve.stop_signals import StopSignals, handlers_restored


@pytest.fixture
def callers_handlers():
    """The caller's own handlers, which record what they hear; the test's before and after."""
    heard: list[int] = []

    def callers(signum, _frame) -> None:
        heard.append(signum)

    before = {sig: signal.signal(sig, callers) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield callers, heard
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def rays_sigterm_handler(*_a, **_kw) -> None:
    """What ray.init does in the main thread: a SIGTERM handler of its own, never put back."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: None)


class FakeDriver:
    """The driver actor: start() answers, wait_ready() never does (Ctrl-C ends the wait)."""

    def __init__(self):
        self.start = self.wait_ready = self.stop = SimpleNamespace(remote=lambda *a: "ref")

    def options(self, **_kw):
        return SimpleNamespace(remote=lambda *a: self)


def stub_direct_launch(monkeypatch, on_start):
    monkeypatch.setattr(cli, "engine_config", lambda args: config(1, "cpu"))
    monkeypatch.setattr(cli, "server_config", lambda args: SimpleNamespace(ssl_certfile=None))
    monkeypatch.setattr(cli.preflight, "check_port", lambda *a: None)
    monkeypatch.setattr(cli, "_ray_on_loopback", lambda args: None)
    monkeypatch.setattr(cli, "_start_ray", rays_sigterm_handler)
    monkeypatch.setattr(ray, "remote", lambda cls: FakeDriver())
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_node_id=lambda: "0" * 56))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: on_start())
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: ([], refs))
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(ray, "shutdown", lambda **kw: None)


def test_launch_hears_ctrl_c_then_gives_the_callers_handlers_back(monkeypatch, capsys,
                                                                   callers_handlers):
    callers, heard = callers_handlers
    # Ctrl-C as the driver starts: tpserve's handler, not the caller's, must hear it.
    stub_direct_launch(monkeypatch, lambda: signal.raise_signal(signal.SIGINT) or "http://x")
    assert cli.launch(parse()) == 0
    assert heard == [], "the caller's handler heard the Ctrl-C meant for the launch"
    assert "tpserve: stopped" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is callers
    assert signal.getsignal(signal.SIGTERM) is callers  # not ray.init's
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    assert heard == [signal.SIGINT, signal.SIGTERM]


def test_a_failed_replicas_launch_gives_the_callers_handlers_back(monkeypatch, capsys,
                                                                  callers_handlers):
    callers, _ = callers_handlers
    monkeypatch.setattr(cli, "_start_ray", rays_sigterm_handler)
    monkeypatch.setattr(app, "check_replicas_fit", lambda *a, **kw: None)
    monkeypatch.setattr(app, "run", lambda *a, **kw: 1 / 0)
    monkeypatch.setattr(app, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "shutdown", lambda **kw: None)
    args = parse("--replicas", "2")
    assert cli.launch_replicas(args, config(2, "cpu"), SimpleNamespace(ssl_certfile=None)) == 1
    assert "start-up failed: division by zero" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is callers
    assert signal.getsignal(signal.SIGTERM) is callers


def test_launch_off_the_main_thread_runs_without_signal_handlers(monkeypatch, capsys):
    """Python sets handlers only from the main thread: the launch used to fail there with
    ValueError after Ray had started, and left it running."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stopped = []
    monkeypatch.setattr(cli, "_start_ray", lambda *a, **kw: None)
    monkeypatch.setattr(app, "check_replicas_fit", lambda *a, **kw: None)
    monkeypatch.setattr(app, "run", lambda *a, **kw: 1 / 0)
    monkeypatch.setattr(app, "shutdown", lambda: stopped.append("serve"))
    monkeypatch.setattr(ray, "shutdown", lambda **kw: stopped.append("ray"))
    box = {}

    def target() -> None:
        try:
            box["rc"] = cli.launch_replicas(parse("--replicas", "2"), config(2, "cpu"),
                                            SimpleNamespace(ssl_certfile=None))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            box["rc"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert box.get("rc") == 1, box
    assert stopped == ["serve", "ray"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_first_signal_stops_the_second_forces():
    signals = StopSignals()
    with handlers_restored():
        signals.install()
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.stop.wait(5.0) and not signals.force.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.force.wait(5.0)


def test_a_wait_hears_a_signal_sent_from_another_thread_at_once():
    signals = StopSignals()
    with handlers_restored():
        signals.install()
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        assert signals.stop.wait(30.0)
        assert time.monotonic() - t0 < 5.0
        timer.join()


def test_a_wait_that_times_out_says_so():
    signals = StopSignals()
    t0 = time.monotonic()
    assert signals.stop.wait(0.2) is False
    assert 0.15 < time.monotonic() - t0 < 5.0


_LANDS_INSIDE = textwrap.dedent("""
    import os, signal, sys, threading
    from tpserve.stop_signals import StopSignals

    if sys.argv[1] == "event":  # the launch's former handler, as the control
        stop, force = threading.Event(), threading.Event()

        def handle(_signum, _frame):
            if stop.is_set():
                force.set()
            stop.set()
        count = lambda: int(stop.is_set()) + int(force.is_set())
    else:
        signals = StopSignals()
        stop, force, handle = signals.stop, signals.force, signals.handle
        count = lambda: signals.count

    landed, nested = [], []

    def tracer(frame, event, _arg):
        # Another signal lands before every line the first handler and its callees run
        # (Event.set's included: inside its lock), as a second Ctrl-C can.
        if event == "line" and not nested:
            landed.append(frame.f_code.co_name)
            os.kill(os.getpid(), signal.SIGUSR1)
        return tracer

    def first(signum, frame):
        sys.settrace(tracer)
        try:
            handle(signum, frame)
        finally:
            sys.settrace(None)

    def second(signum, frame):
        nested.append(1)
        try:
            handle(signum, frame)
        finally:
            nested.pop()

    signal.signal(signal.SIGUSR1, second)
    signal.signal(signal.SIGINT, first)
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    print("counted", min(count(), 2), force.wait(10.0), sorted(set(landed)), flush=True)
""")


def _land_inside(kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _LANDS_INSIDE, kind], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.mark.timeout(60)
def test_a_signal_landing_inside_the_first_handler_does_not_hang():
    """The launch hung for good when a second SIGINT/SIGTERM (Ctrl-C twice, or a supervisor
    forwarding one) landed while the first handler was inside threading.Event.set, which
    takes a lock the nested handler then waits for. The child lands the second signal at
    the first line the handler's callees run; the control shows the former handler hang."""
    control = _land_inside("event")
    try:
        assert control.stdout.readline().strip() == "ready"
        with pytest.raises(subprocess.TimeoutExpired):
            control.wait(timeout=4)  # the former handler: stuck in Event.set
    finally:
        control.kill()
        control.communicate()
    out, err = _land_inside("flags").communicate(timeout=50)
    assert out.splitlines()[-1].startswith("counted 2 True"), out + err
