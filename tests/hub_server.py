"""A loopback HTTP server that answers the Hugging Face hub API calls huggingface_hub makes to
download one repository (model info by revision, recursive tree listing, resolve/<rev>/<file>
with the commit and ETag headers), so hub downloads are tested without the internet; and a
SilentHub that accepts connections and never answers (a hung hub or proxy)."""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _QuietServer(ThreadingHTTPServer):
    """A client that went away mid-answer (a cancelled or timed-out download, which tests
    cause on purpose) is not an error of the hub: its handler thread may still be writing
    after the test ended, and socketserver's report of the broken pipe would land in a
    later test's captured stderr."""

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class FakeHub:
    """pace=(size, pause): the weights (*.safetensors) are sent `size` bytes at a time with
    `pause` seconds between (a slow but steady hub); stall_after=N: their first N bytes are
    sent, then nothing until the hub closes (a hub that stops in the middle of a file);
    tokens={...}: the only tokens it accepts (another one is answered 401 "Invalid
    credentials", as the hub does); granted={...}: a gated repository, whose files only those
    tokens may fetch (else 401 without a token, 403 with one); refs=(...): branches, tags or
    refs/pr/N that name `commit` besides main."""

    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str = "c" * 40,
                 pace: tuple[int, float] | None = None, stall_after: int | None = None,
                 tokens: set[str] | None = None, granted: set[str] | None = None,
                 refs: tuple[str, ...] = ()) -> None:
        self.repo_id, self.files, self.commit, self.refs = repo_id, files, commit, refs
        self.pace, self.stall_after = pace, stall_after
        self.tokens, self.granted = tokens, granted
        self._closing = threading.Event()
        self.requests: list[str] = []  # "METHOD path" of every request, in order
        self.auth: set[str | None] = set()  # Authorization headers seen
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @classmethod
    def from_dir(cls, repo_id: str, path: Path, extra: dict[str, bytes] | None = None):
        files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        return cls(repo_id, {**files, **(extra or {})})

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()  # lets a stalled answer end
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self) -> set[str]:
        """Files whose content was fetched (GET on resolve/)."""
        marker = f"/{self.repo_id}/resolve/"
        return {r.split(marker, 1)[1].split("/", 1)[1] for r in self.requests
                if r.startswith("GET ") and marker in r}

    # --- routes -------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        raw = urlsplit(h.path).path  # a revision with slashes (refs/pr/1) comes %-quoted
        path = unquote(raw)
        self.requests.append(f"{h.command} {path}")
        self.auth.add(h.headers.get("Authorization"))
        auth = h.headers.get("Authorization")
        if auth is not None and self.tokens is not None \
                and auth not in {f"Bearer {t}" for t in self.tokens}:
            return self._error(h, 401, None, "Invalid credentials in Authorization header")
        if self.granted is not None and "/resolve/" in path \
                and auth not in {f"Bearer {t}" for t in self.granted}:
            return self._error(h, 403 if auth else 401, "GatedRepo",
                               f"Access to model {self.repo_id} is restricted.")
        api = f"/api/models/{self.repo_id}/"
        if path.startswith("/api/models/") and not path.startswith(api):
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        if path.startswith(api + "revision/"):
            if not self._known(unquote(raw[len(api + "revision/"):])):
                return self._error(h, 404, "RevisionNotFound", "Invalid rev id")
            return self._json(h, {"id": self.repo_id, "sha": self.commit, "private": False,
                                  "siblings": [{"rfilename": f} for f in self.files]})
        if path.startswith(api + "tree/"):
            return self._json(h, [self._entry(name) for name in self.files])
        marker = f"/{self.repo_id}/resolve/"
        if path.startswith(marker):
            rev, name = (unquote(part) for part in raw[len(marker):].split("/", 1))
            if not self._known(rev):
                return self._error(h, 404, "RevisionNotFound", "Invalid rev id")
            if name not in self.files:
                return self._error(h, 404, "EntryNotFound", "Entry not found")
            data = self.files[name]
            h.send_response(200)
            h.send_header("X-Repo-Commit", self.commit)
            h.send_header("ETag", f'"{self._etag(name)}"')
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if body:
                self._send_body(h, data, weights=name.endswith(".safetensors"))
            return None
        return self._error(h, 404, None, "not a route of this fake hub")

    def _send_body(self, h: BaseHTTPRequestHandler, data: bytes, weights: bool) -> None:
        if weights and self.stall_after is not None:
            h.wfile.write(data[:self.stall_after])
            h.wfile.flush()
            self._closing.wait()
        elif weights and self.pace is not None:
            size, pause = self.pace
            for start in range(0, len(data), size):
                if start:
                    time.sleep(pause)
                h.wfile.write(data[start:start + size])
                h.wfile.flush()
        else:
            h.wfile.write(data)

    def _known(self, rev: str) -> bool:
        return rev in ("main", self.commit, *self.refs)

    def _etag(self, name: str) -> str:
        data = self.files[name]
        if name.endswith(".safetensors"):  # LFS files: the sha256 of the content
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id

    def _entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "path": name, "size": len(data),
                 "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"oid": self._etag(name), "size": len(data), "pointerSize": 134}
        return entry

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
            h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


class SilentHub:
    """Accepts every TCP connection and never sends a byte: a hub, mirror or proxy that hangs.
    The connections are held open (so the client waits on them) until the context ends."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def __enter__(self) -> SilentHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        for conn in self._held:
            conn.close()
