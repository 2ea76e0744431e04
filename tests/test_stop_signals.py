"""`tpserve launch`'s Ctrl-C handling (tpserve/stop_signals.py): the first signal stops, the
second skips the drain, nothing in the handler can wait on a lock, and the caller's handlers
come back afterwards."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tpserve.stop_signals import StopSignals


def test_first_signal_stops_the_second_forces():
    signals = StopSignals()
    with signals.installed():
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.stop.wait(5.0) and not signals.force.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.force.wait(5.0)


def test_a_wait_hears_a_signal_sent_from_another_thread_at_once():
    signals = StopSignals()
    with signals.installed():
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


def test_the_callers_handlers_come_back():
    def mine(_signum, _frame):
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with StopSignals().installed() as signals:
            assert signal.getsignal(signal.SIGINT) == signals.handle
            assert signal.getsignal(signal.SIGTERM) == signals.handle
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_outside_the_main_thread_nothing_is_installed():
    seen = {}

    def run():
        with StopSignals().installed():
            seen["handler"] = signal.getsignal(signal.SIGINT)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["handler"] == signal.getsignal(signal.SIGINT)


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
