"""The driver: owns the engine loop and serves HTTP. Runs as the Ray actor "driver" (pinned
to the node that launched it, so the HTTP port is where the user expects), or in-process."""

from __future__ import annotations

import logging
import socket
import threading
import time

from tpserve.config import EngineConfig, ServerConfig

log = logging.getLogger(__name__)


class Driver:
    def __init__(self, cfg: EngineConfig, host: str = "127.0.0.1", port: int = 8080,
                 log_level: str = "info", server: ServerConfig | None = None) -> None:
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.cfg, self.host, self.port, self.log_level = cfg, host, port, log_level
        self.server_cfg = server or ServerConfig()
        self.backend = None
        self._server = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        # rayops hook: shown in the Ray dashboard's actors view.
        return f"Driver({self.cfg.model.model_id}, http://{self.host}:{self.port})"

    def start(self) -> str:
        """Start the HTTP server (health answers 503 until loaded) and the model load;
        returns the base URL once the port is bound."""
        import uvicorn

        from tpserve.cluster.ray_metrics import EngineMetrics
        from tpserve.engine.async_engine import AsyncEngine
        from tpserve.engine.rebuild import RebuildPolicy
        from tpserve.server.app import build_app
        from tpserve.server.http_protocol import http_protocol

        cfg = self.cfg
        # The same factory builds the group at start and after a lost shard (a rebuild).
        self.backend = AsyncEngine(lambda: launch_engine(cfg), cfg.model.model_id,
                                   cfg.scheduler.max_concurrent_requests,
                                   lambda stats: EngineMetrics(stats, cfg.model.model_id),
                                   RebuildPolicy(cfg.parallel.max_rebuilds,
                                                 cfg.parallel.rebuild_backoff_s))
        app = build_app(self.backend, self.server_cfg)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}; "
                               "pick another --port") from None
        self.port = sock.getsockname()[1]
        tls = self.server_cfg.ssl_certfile is not None
        # http_protocol: request heads bounded (431 over 64 KiB, 408 after 30 s)
        config = uvicorn.Config(app, log_level=self.log_level, access_log=False,
                                http=http_protocol(),
                                timeout_graceful_shutdown=5, server_header=False,
                                ssl_certfile=self.server_cfg.ssl_certfile,
                                ssl_keyfile=self.server_cfg.ssl_keyfile)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="tpserve-http", daemon=True)
        self._thread.start()
        self.backend.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"{'https' if tls else 'http'}://{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float | None = None) -> dict:
        """Block until every shard has loaded; raises the load error if there was one."""
        self.backend.wait_ready(timeout_s)
        e = self.backend.engine
        return {"kv_cache_blocks": e.num_blocks, "backend": e.load_reports[0].backend,
                "passed_over": e.load_reports[0].passed_over,
                "param_bytes_per_shard": [r.param_bytes for r in e.load_reports],
                "load_seconds": max(r.seconds for r in e.load_reports),
                "warmup_seconds": e.warmup_seconds,
                # Where the start-up went (tpserve/startup.py), from the actors' request on.
                "placed_at": getattr(e, "placed_at", None),
                "startup": getattr(e, "startup", [])}

    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready()

    def health(self) -> list[dict]:
        return self.backend.engine.executor.health()

    def drain(self, timeout_s: float) -> int:
        """Stop accepting requests (they get 503) and wait up to `timeout_s` for the ones in
        flight to finish; returns how many were still running (rayops: shutdown)."""
        if self.backend is None:
            return 0
        self.backend.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.backend.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.backend.inflight

    def stop(self) -> None:
        # The engine first: the requests the drain left end with an error event while the
        # HTTP server still writes, instead of uvicorn cancelling them mid-stream (a
        # traceback in the log, a connection cut without a word).
        if self.backend is not None:
            self.backend.stop()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


def launch_engine(cfg: EngineConfig):
    """The replica the driver serves: the engine core in rank 0's actor, ranks 1..tp-1 as
    followers; tokenization and output processing stay here."""
    from tpserve.cluster.core_client import CoreClient

    return CoreClient(cfg)
