"""`tpserve launch` called in-process (tpserve.cli.main from a program or a notebook) hears
Ctrl-C while it runs and gives the caller's SIGINT and SIGTERM handlers back on return; off
the main thread it runs without them. No Ray cluster: Ray's calls are stubbed."""

from __future__ import annotations

import signal
import threading
from types import SimpleNamespace

import pytest
import ray
from test_serve_cli import config, parse

from tpserve import cli
from tpserve.serve import app


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
