"""Shared fixtures: a local multi-process Ray cluster, tiny checkpoints on disk, and the
HTTP app over a fake backend."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray's metrics reach the Prometheus export within a second (the default is 10 s).
os.environ.setdefault("RAY_metrics_report_interval_ms", "500")


def pytest_report_header(config) -> str:
    """The oracle's version heads every run: the tests compare against transformers, and
    a GPU machine may hold another version than CI (2026-12-05: 5.17.0 there, whose GPT-OSS
    and longrope generate differ from 5.25's; docs/kernels-gpu-conformance.md)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return [f"oracle: transformers {of('transformers')}, torch {of('torch')}", *_sigint_note()]


def _sigint_note() -> list[str]:
    """Every child inherits an ignored or blocked SIGINT through exec: said at the top of the
    run, so that a child that ignores Ctrl-C is not blamed on a test (2026-12-06: two full
    runs started by `bash -c 'pytest ... &'` had it ignored; tests/test_hub_stall.py)."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        return ["SIGINT: ignored in this process (a shell without job control starts a "
                "background command so); its children inherit it"]
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return ["SIGINT: blocked in this process; its children inherit it"]
    return []


RAY_ARGS = dict(num_cpus=4, include_dashboard=False, log_to_driver=False,
                namespace="tpserve-tests")


def ensure_ray():
    """The session's local Ray cluster, started if it is not running: 4 logical CPUs so
    tp = 4 can be placed on a 2-core machine (again after a test that shut it down)."""
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_ARGS)
    return ray


@pytest.fixture(scope="session")
def _ray_session():
    """Whatever Ray this session started is shut down (no processes left) at its end."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """Ray, running, for one test (ensure_ray)."""
    return ensure_ray()


@pytest.fixture(scope="module")
def ray_for_module(_ray_session):
    """Ray, running, for a module-scoped fixture that holds actors across its tests."""
    return ensure_ray()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(models_dir) -> Path:
    """Llama, 4 query heads and 2 KV heads (replicated at tp = 4), vocab 301 (divisible by
    neither 2 nor 4), untied head."""
    from tiny_models import llama_config, save_model

    return save_model(llama_config(), models_dir / "llama")


# The app (tpserve.server.app.build_app) over one fake backend, for modules that test the
# HTTP layer: `server` is (backend, base URL), shared by the module; `backend` is that fake,
# reset to healthy and idle for each test. Modules with their own app define their own.
@pytest.fixture(scope="module")
def server():
    from fake_backend import FakeBackend, serve

    from tpserve.server.app import build_app

    fake = FakeBackend()
    with serve(build_app(fake)) as url:
        yield fake, url


@pytest.fixture
def backend(server):
    return server[0].reset()
