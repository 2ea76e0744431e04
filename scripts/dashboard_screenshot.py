"""Screenshot a page of the Ray dashboard with headless Chromium (Debian's `chromium`).

Ray's token authentication is on by default, and a headless browser cannot type the token
into the dashboard's prompt, so this serves the dashboard through a loopback proxy that adds
`Authorization: Bearer <token>` (the token `ray get-auth-token` prints) to every request.

    python scripts/dashboard_screenshot.py --page actors --out docs/img/ray-dashboard-actors.png
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def token() -> str | None:
    out = subprocess.run(["ray", "get-auth-token"], capture_output=True, text=True)
    return out.stdout.strip() or None


def proxy(upstream: str, bearer: str | None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            req = urllib.request.Request(upstream + self.path)
            if bearer:
                req.add_header("Authorization", f"Bearer {bearer}")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, headers, body = r.status, r.headers, r.read()
            except urllib.error.HTTPError as e:
                status, headers, body = e.code, e.headers, e.read()
            self.send_response(status)
            for k in ("Content-Type", "Cache-Control"):
                if headers.get(k):
                    self.send_header(k, headers[k])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dashboard", default="http://127.0.0.1:8265")
    p.add_argument("--page", default="actors", help="actors, cluster, metrics, ...")
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="1280,720")
    p.add_argument("--wait-ms", type=int, default=15000, help="time for the page to render")
    args = p.parse_args()
    server = proxy(args.dashboard, token())
    url = f"http://127.0.0.1:{server.server_address[1]}/#/{args.page}"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--window-size={args.size}",
                    f"--virtual-time-budget={args.wait_ms}", f"--screenshot={args.out}", url],
                   check=True, capture_output=True)
    server.shutdown()
    print(args.out)


if __name__ == "__main__":
    main()
