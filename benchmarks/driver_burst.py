"""The driver's share of a served burst, without a device: the real HTTP app, AsyncEngine
bridge and output processor (what `tpserve launch` runs in its driver actor) in front of a
simulated engine core that produces tokens on the timeline measured on one H200 for the
256 x 256/256 burst (prefill steps admitting 16 requests in ~95 ms, then decode steps of
~12 ms), in its own thread, handed over through a long poll as CoreClient does. An aiohttp
client in another process sends the burst (details on, as TGI's client asks).

What it reports: the driver process's CPU time over the burst (its threads share one GIL,
so this is what competes with the bridge thread), the client's wall time against the simulated core's (first step to last
step), so the difference is what the driver adds: the start (the first request reaching the
core) and the tail (the last response after the last step), and how far the driver's
output processing fell behind the core (the largest number of steps merged in one poll).

    python benchmarks/driver_burst.py                  # 256 requests, the H200 timeline
    python benchmarks/driver_burst.py --loop asyncio --http h11   # without uvloop/httptools
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from math import nan
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


class SimCore:
    """The engine shape AsyncEngine drives (as CoreClient: tokenize, add_requests, abort,
    has_work, step as a long poll, stats), over a core thread that steps on a fixed
    timeline: a step admitting waiting requests (up to `admit` per step) takes prefill_s,
    a decode-only step decode_s; every running request gets one token per step."""

    def __init__(self, tokenizer, args) -> None:
        from tpserve.engine.output_processor import OutputProcessor

        self.tokenizer, self.args = tokenizer, args
        self.output = OutputProcessor(tokenizer, frozenset(tokenizer.all_special_ids))
        self.cfg = SimpleNamespace(model=SimpleNamespace(dtype="bfloat16"),
                                   parallel=SimpleNamespace(device="cuda", tp_size=1, placement="pack"),
                                   cache=SimpleNamespace(block_size=16),
                                   lora=SimpleNamespace(names=()))
        self.num_blocks, self.max_input_tokens, self.max_model_len = 100_000, 8000, 8192
        self.load_reports = [SimpleNamespace(backend="simulated")]
        self.hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"])
        self.executor = SimpleNamespace(health=lambda: [])
        self._cv = threading.Condition()
        self._waiting: list[tuple[int, int, int]] = []  # (seq_id, prompt tokens, max new)
        self._out: list = []
        self._ids = 0
        self.steps: list[tuple[float, float]] = []  # (start, end) wall times
        self.merged = 0  # the most steps one poll returned
        self._polled_steps = 0
        self._stop = False
        threading.Thread(target=self._core, daemon=True, name="sim-core").start()

    def tokenize(self, prompt, truncate=None, add_special_tokens=True):
        from tpserve.engine.engine import tokenize

        return tokenize(self.tokenizer, prompt, truncate, add_special_tokens)

    def add_requests(self, requests):
        out = []
        with self._cv:
            for ids, params in requests:
                self._ids += 1
                self.output.add(self._ids, params)
                self._waiting.append((self._ids, len(ids), params.max_new_tokens))
                out.append(SimpleNamespace(seq_id=self._ids, params=params))
            self._cv.notify_all()
        return out

    def abort(self, seq_id):
        self.output.remove(seq_id)

    def has_work(self):
        return bool(self.output.requests)

    def stats(self):
        return {}

    def _core(self) -> None:
        from tpserve.engine.outputs import TokenOutput

        running: dict[int, list[int]] = {}  # seq_id -> [generated, max new, prompt tokens]
        a = self.args
        while not self._stop:
            with self._cv:
                while not self._waiting and not running and not self._stop:
                    self._cv.wait(0.1)
                admit, self._waiting = self._waiting[:a.admit], self._waiting[a.admit:]
            t0 = time.time()
            for sid, plen, new in admit:
                running[sid] = [0, new, plen]
            time.sleep(a.prefill_s if admit else a.decode_s)  # the device's step
            outs = []
            for sid, st in list(running.items()):
                st[0] += 1
                done = st[0] >= st[1]
                outs.append(TokenOutput(sid, 1000 + (sid * 7 + st[0]) % 90000, -0.5, [],
                                        st[0], st[2], "length" if done else None))
                if done:
                    del running[sid]
            with self._cv:
                self._out.append(outs)
                self.steps.append((t0, time.time()))
                self._cv.notify_all()

    def step(self):
        with self._cv:
            self._cv.wait_for(lambda: self._out, timeout=0.05)
            got, self._out = self._out, []
        self.merged = max(self.merged, len(got))
        events, _ = self.output.process([o for step in got for o in step])
        return events, None

    def shutdown(self):
        self._stop = True


def serve(args, model: Path):
    """The driver as cluster/driver.py builds it: AsyncEngine + the app on uvicorn in a
    thread of this process."""
    import uvicorn
    from transformers import AutoTokenizer

    from tpserve.engine.async_engine import AsyncEngine
    from tpserve.server.app import build_app

    if args.switch_ms:  # this process's GIL hand-over interval (CPython's default: 5 ms)
        sys.setswitchinterval(args.switch_ms / 1e3)
    tok = AutoTokenizer.from_pretrained(model)
    core = SimCore(tok, args)
    backend = AsyncEngine(lambda: core, "sim", 4 * args.requests)
    app = build_app(backend)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, loop=args.loop,
                            http=args.http)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    backend.start()
    backend.wait_ready(60)
    while not server.started:
        time.sleep(0.05)
    return core, backend, (server, thread), f"http://127.0.0.1:{port}"


def client(url: str, n: int, plen: int, new: int, vocab: int, q) -> None:
    """One burst from another process, with serve_bench's prompts and client session:
    (t0 wall, [response wall times], tokens)."""
    import random

    from serve_bench import prompt, session

    async def run():
        rng = random.Random(n)
        texts = [prompt(plen, rng, vocab) for _ in range(n)]
        async with session(n) as c:
            async def one(t):
                body = {"inputs": t, "parameters": {"max_new_tokens": new, "details": True}}
                async with c.post(url + "/generate", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"POST /generate answered {r.status}: "
                                           f"{(await r.text())[:300]}")
                    got = (await r.json())["details"]["generated_tokens"]
                return time.time(), got

            t0 = time.time()
            res = await asyncio.gather(*(one(t) for t in texts))
        return t0, [r[0] for r in res], sum(r[1] for r in res)

    try:
        q.put(asyncio.run(run()))
    except Exception as exc:  # the parent waits on q: say why rather than leave it waiting
        q.put(f"{type(exc).__name__}: {exc}")


def burst(args, url: str) -> tuple[float, list[float], int]:
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(
        target=client, args=(url, args.requests, args.prompt, args.new, 100_000, q))
    p.start()
    out = q.get(timeout=600)
    p.join(60)
    if isinstance(out, str):
        raise SystemExit(f"driver_burst: the burst failed: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--admit", type=int, default=16, help="requests a prefill step admits")
    ap.add_argument("--prefill-s", type=float, default=0.095)
    ap.add_argument("--decode-s", type=float, default=0.012)
    ap.add_argument("--loop", default="auto", help="uvicorn's --loop (auto: uvloop if installed)")
    ap.add_argument("--http", default="auto", help="uvicorn's --http (auto: httptools if installed)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="the driver process's GIL switch interval (sys.setswitchinterval; "
                         "default: CPython's)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from serve_bench import make_model_dir

    from tpserve.engine.step_trace import ENV, read

    cfg = Path(tempfile.mkdtemp()) / "config.json"
    # The bridge's own timeline (arrivals at the engine, submissions to the core), which
    # splits the start: the client and the HTTP handlers, then the bridge.
    trace = cfg.parent / "driver.trace"
    os.environ[ENV] = str(trace)
    cfg.write_text(json.dumps({"vocab_size": 100_000}))
    model = make_model_dir(cfg, cfg.parent / "model")
    core, backend, (server, thread), url = serve(args, model)
    rows = []
    try:
        for _ in range(args.repeat):
            core.steps.clear()
            core.merged = 0
            cpu0 = time.process_time()
            t0, done, toks = burst(args, url)
            cpu = time.process_time() - cpu0
            first, last = core.steps[0][0], core.steps[-1][1]
            time.sleep(0.6)  # the bridge writes its trace once idle
            drv = Path(str(trace) + ".driver")
            rows_t = read(str(drv), t0)
            drv.unlink(missing_ok=True)
            arrive = [r["t"] - t0 for r in rows_t if r["kind"] == "arrive"]
            submit = [r["t"] - t0 for r in rows_t if r["kind"] == "submit"]
            rows.append({"wall": max(done) - t0, "core": last - first, "start": first - t0,
                         "arrive": (arrive[0], arrive[-1]) if arrive else (nan, nan),
                         "submit": submit[0] if submit else nan,
                         "tail": max(done) - last, "merged": core.merged, "tokens": toks, "cpu": cpu,
                         "steps": len(core.steps)})
            print(rows[-1], flush=True)
    finally:
        # Joined, not left to die with the interpreter: a daemon thread still inside uvloop
        # while Python finalizes crashed the process (exit status 139) after its report.
        server.should_exit = True
        thread.join(30)
        backend.stop()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    head = (f"Machine: CPU ({platform.processor() or platform.machine()}), "
            f"{datetime.date.today().isoformat()}, commit {commit}{' ' + args.label if args.label else ''}; "
            f"{args.requests} x {args.prompt}/{args.new}, simulated core (prefill "
            f"{args.prefill_s * 1e3:.0f} ms per {args.admit} requests, decode "
            f"{args.decode_s * 1e3:.0f} ms), uvicorn loop {args.loop}, http {args.http}"
            f", GIL switch interval {sys.getswitchinterval() * 1e3:g} ms")
    lines = [head, "", "| burst | client wall s | core s (first step - last) | start s | "
             "requests reach the engine s (first - last) | first submission to the core s | "
             "tail s (last response - last step) | driver overhead % | most steps in one poll | "
             "driver CPU s | tokens answered |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['wall']:.3f} | {r['core']:.3f} | {r['start']:.3f} | "
                     f"{r['arrive'][0]:.3f} - {r['arrive'][1]:.3f} | {r['submit']:.3f} | "
                     f"{r['tail']:.3f} | {100 * (r['wall'] / r['core'] - 1):.1f} | "
                     f"{r['merged']} | {r['cpu']:.2f} | {r['tokens']} of "
                     f"{args.requests * args.new} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
