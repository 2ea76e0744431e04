"""The served path as a user meets it: `tpserve launch` in a subprocess, measured from an HTTP
client. Prints a table and appends it (with machine, date and commit) to --out.

    python benchmarks/serve_bench.py --model-config tests/data/configs/Meta-Llama-3-8B.json \
        --device cuda --dtype bfloat16 --out results.md [--tree old=/path/to/other/checkout]

What it measures, per launched tree (several trees run one after another in one run, so their
ratios are side by side):
- launch to ready: process start until GET /health answers 200;
- single stream: /generate_stream with a ~256-token prompt and 256 new tokens, three times;
  median and p99 of the gaps between streamed tokens, median time to first token;
- throughput: C concurrent /generate requests of ~256 prompt tokens and 256 new tokens
  (C = 32 and 256 by default); generated tokens / wall time; with --client-procs N also the
  same bursts sent from N client processes at once;
- optionally (--long) time to first token and token gaps for 1k/4k/8k-token prompts;
- optionally (--py-spy PATH) a py-spy profile of the engine-core and driver actors during the
  largest burst (benchmarks/spy_summary.py reads them): where each thread's time went, and
  which threads hold the GIL.

The model is a config.json (random weights, --load-format dummy) with a WordLevel tokenizer
over the whole vocabulary, so every sampled id decodes and prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]


def make_model_dir(config: Path, out: Path) -> Path:
    """config.json plus a WordLevel tokenizer whose words are the token ids themselves."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(config.read_text())
    shutil.copy(config, out / "config.json")
    vocab = {f"w{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(n: int, rng: random.Random, vocab: int) -> str:
    # Ids from a middle range: clear of special tokens at either end of real vocabularies
    # (a small test vocabulary: its upper three quarters).
    lo = min(1000, vocab // 4)
    return " ".join(f"w{rng.randrange(lo, min(vocab, 100_000))}" for _ in range(n))


class Server:
    def __init__(self, tree: Path, model: Path, args, log: Path,
                 extra: list[str] = (), env_extra: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tpserve.cli", "launch", "--model", str(model),
               "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
               "--tp", str(args.tp), "--port", str(self.port), "--no-dashboard",
               "--max-batch-size", str(args.max_batch_size),
               "--max-concurrent-requests", str(max(args.concurrency) * 2),
               "--max-total-tokens", str(args.max_total_tokens), *args.launch_args, *extra]
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(
                       [p for p in (os.environ.get("PYTHONPATH_PREFIX"), str(tree)) if p]),
                   **(env_extra or {}))
        self.trace = None
        if getattr(args, "step_trace", False):  # the engine's timeline (step_trace.py)
            self.trace = log.with_suffix(".steps.jsonl")
            self.trace.unlink(missing_ok=True)
            Path(str(self.trace) + ".driver").unlink(missing_ok=True)
            env["TPSERVE_STEP_TRACE"] = str(self.trace)
        self.log = open(log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def with_adapter(params: dict, adapter: str | None) -> dict:
    """A request's parameters, naming a LoRA adapter where one is given (--lora)."""
    return params if adapter is None else {**params, "adapter_id": adapter}


def adapter_of(i: int, names: list[str], mode: str) -> str | None:
    """The adapter request i names (round robin over the loaded ones): every request
    (`all`), every other one (`half`, so steps mix adapter and base rows) or none."""
    if not names or mode == "none" or (mode == "half" and i % 2):
        return None
    return names[(i // (2 if mode == "half" else 1)) % len(names)]


async def stream_once(client: aiohttp.ClientSession, url: str, text: str, new: int,
                      adapter: str | None = None):
    """(time to first token, [gaps between later tokens]) of one /generate_stream call."""
    body = {"inputs": text, "parameters": with_adapter({"max_new_tokens": new}, adapter)}
    t0 = time.perf_counter()
    stamps = []
    async with client.post(url + "/generate_stream", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data:"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps


SPLIT_STATS = ("steps", "step_busy_seconds", "step_device_wait_seconds", "prefill_steps",
               "step_tokens", "driver_poll_wait_seconds", "driver_process_seconds",
               "bridge_step_seconds")


def engine_stats(url: str) -> dict[str, float]:
    """The server's cumulative engine gauges (tpserve_engine{stat=...} on /metrics)."""
    return parse_stats(httpx.get(url + "/metrics", timeout=10).text)


def parse_stats(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith('tpserve_engine{stat="'):
            name, _, value = line[len('tpserve_engine{stat="'):].partition('"} ')
            out[name] = float(value)
    return out


def split(before: dict, after: dict, wall: float) -> dict:
    """Where a burst's wall time went, from the engine gauges' differences: the engine
    core's steps (busy, of which waiting for the device) and idle time, and the driver's
    poll and output processing."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPLIT_STATS}
    steps = max(d["steps"], 1.0)
    return {"wall_s": wall, "steps": d["steps"], "prefill_steps": d["prefill_steps"],
            "tokens_per_step": d["step_tokens"] / steps,
            "core_busy_pct": 100 * d["step_busy_seconds"] / wall,
            "step_ms": 1e3 * d["step_busy_seconds"] / steps,
            "device_wait_ms": 1e3 * d["step_device_wait_seconds"] / steps,
            "host_ms": 1e3 * (d["step_busy_seconds"] - d["step_device_wait_seconds"]) / steps,
            "driver_process_pct": 100 * d["driver_process_seconds"] / wall,
            "driver_poll_wait_pct": 100 * d["driver_poll_wait_seconds"] / wall}


class Profiler:
    """py-spy on the engine-core and driver actors (found by their process titles) while a
    burst runs: the core twice (every thread with idle time, and only GIL holders), the
    driver once. Raw collapsed stacks go to LOGS/spy_LABEL_*.txt."""

    TARGETS = (("core", "ray::EngineCore", ["--idle"]), ("core_gil", "ray::EngineCore", ["--gil"]),
               ("driver", "ray::Driver", ["--idle"]))

    def __init__(self, spy: str, logs: Path, label: str) -> None:
        self.spy, self.logs, self.label = spy, logs, label
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Profiler:
        for name, title, flags in self.TARGETS:
            pids = subprocess.run(["pgrep", "-f", title], capture_output=True,
                                  text=True).stdout.split()
            if not pids:
                print(f"[profile] no process titled {title}", flush=True)
                continue
            out = self.logs / f"spy_{self.label}_{name}.txt"
            self.procs.append(subprocess.Popen(
                [self.spy, "record", "--pid", pids[0], "--threads", "--nonblocking",
                 "--rate", "500", "--format", "raw", "-o", str(out), *flags],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections + 8),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def generate_once(client: aiohttp.ClientSession, url: str, text: str, new: int,
                        done: list[float], clock, adapter: str | None = None) -> int:
    """One /generate of a burst (details on, as TGI's client asks): the tokens it got; the
    response's arrival (on `clock`) goes to `done`."""
    body = {"inputs": text,
            "parameters": with_adapter({"max_new_tokens": new, "details": True}, adapter)}
    async with client.post(url + "/generate", json=body) as r:
        r.raise_for_status()
        got = (await r.json())["details"]["generated_tokens"]
    done.append(clock())
    return got


def watch_s(trace: Path | None) -> float:
    """How often the single-client burst reads /metrics. Each read costs the driver's event
    loop ~0.6 ms on the H200 host (prometheus_client writing every series; py-spy, 2026-12-03),
    a third of that loop's work over a burst at 20 ms; with --step-trace the trace times the
    core's steps, so the gauges are read five times less often."""
    return 0.1 if trace is not None else 0.02


async def throughput(url: str, n: int, plen: int, new: int, vocab: int, profiler=None,
                     trace: Path | None = None, adapters: list[str | None] | None = None
                     ) -> tuple[float, int, dict]:
    """adapters: the adapter each request names (None: the base model), cycled."""
    rng = random.Random(n)
    texts = [prompt(plen + rng.randrange(-16, 17), rng, vocab) for _ in range(n)]
    adapters = adapters or [None]
    # aiohttp, as TGI's own client uses: httpx's connection pool costs seconds at this
    # concurrency (measured: 256 responses released at once reach an httpx client over
    # 5 s, an aiohttp one over 0.2 s), which would be charged to the server.
    async with session(n) as client:

        done: list[float] = []

        def one(i: int, t: str):
            return generate_once(client, url, t, new, done, time.perf_counter,
                                 adapters[i % len(adapters)])

        async def watch(samples: list) -> None:
            """The engine's step count every watch_s(trace): when the core started and
            stopped."""
            every = watch_s(trace)
            while True:
                async with client.get(url + "/metrics") as r:
                    text = await r.text()
                samples.append((time.perf_counter(), parse_stats(text).get("steps", 0.0)))
                await asyncio.sleep(every)

        before = engine_stats(url)
        samples: list = []
        with profiler or contextlib.nullcontext():
            watcher = asyncio.create_task(watch(samples))
            t0_wall, t0 = time.time(), time.perf_counter()
            counts = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
            wall = time.perf_counter() - t0
            watcher.cancel()
        after = engine_stats(url)
    where = split(before, after, wall)
    where.update(timeline(samples, done, t0, before.get("steps", 0.0)))
    if trace is not None:
        await asyncio.sleep(0.5)  # the core and the driver write their traces once idle
        where["trace"] = trace_split(trace, t0_wall, wall, [d - t0 for d in done])
    return sum(counts) / wall, sum(counts), where


def burst_part(url: str, texts: list[str], new: int, start: float,
               adapters: list[str | None] | None = None) -> tuple[int, list[float]]:
    """One client process's share of a burst (--client-procs): wait for the wall-clock
    `start` the parent set for every process, send these requests at once, and return the
    tokens received and each response's wall-clock arrival."""

    async def run() -> tuple[int, list[float]]:
        async with session(len(texts)) as client:
            done: list[float] = []
            await asyncio.sleep(max(0.0, start - time.time()))
            names = adapters or [None] * len(texts)
            counts = await asyncio.gather(
                *(generate_once(client, url, t, new, done, time.time, a)
                  for t, a in zip(texts, names, strict=True)))
            return sum(counts), done

    return asyncio.run(run())


class TailProfiler:
    """py-spy on the driver and core actors, GIL holders only, for one second from `offset`
    seconds after a burst's start: the burst's last steps and answers, which a whole-burst
    profile (Profiler) cannot separate from the rest. Raw stacks go to
    LOGS/spy_tail_LABEL_{driver,core}.txt."""

    def __init__(self, spy: str, logs: Path, label: str, offset: float) -> None:
        self.spy, self.logs, self.label, self.offset = spy, logs, label, offset
        self.thread: threading.Thread | None = None

    def arm(self, start: float) -> None:
        self.thread = threading.Thread(target=self._run, args=(start,), daemon=True)
        self.thread.start()

    def _run(self, start: float) -> None:
        targets = [(name, subprocess.run(["pgrep", "-f", title], capture_output=True,
                                         text=True).stdout.split())
                   for name, title in (("driver", "ray::Driver"), ("core", "ray::EngineCore"))]
        time.sleep(max(0.0, start + self.offset - time.time()))
        procs = [subprocess.Popen(
            [self.spy, "record", "--pid", pids[0], "--threads", "--nonblocking", "--gil",
             "--rate", "1000", "--duration", "1", "--format", "raw",
             "-o", str(self.logs / f"spy_tail_{self.label}_{name}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pids in targets if pids]
        for p in procs:
            p.wait(60)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(90)


def spread_throughput(pool, procs: int, url: str, n: int, plen: int, new: int,
                      vocab: int, trace: Path | None = None,
                      tail: TailProfiler | None = None,
                      adapters: list[str | None] | None = None) -> tuple[float, int, dict]:
    """The burst of `throughput` (same prompts) sent by `procs` client processes at once:
    one Python process sends 256 requests one after another through its event loop, so the
    server sees its first request only after the client's own work for many of them
    (0.05-0.12 s on the H200 host); 256 users would not share one process. Tokens over the
    time from the common start to the last response."""
    rng = random.Random(n)
    texts = [prompt(plen + rng.randrange(-16, 17), rng, vocab) for _ in range(n)]
    start = time.time() + 1.0  # every process is waiting on the clock by then
    if tail is not None:
        tail.arm(start)
    adapters = adapters or [None]
    names = [adapters[i % len(adapters)] for i in range(n)]  # as throughput() names them
    futs = [pool.submit(burst_part, url, texts[i::procs], new, start, names[i::procs])
            for i in range(procs)]
    parts = [f.result() for f in futs]
    if tail is not None:
        tail.join()
    tokens = sum(p[0] for p in parts)
    done = [t - start for p in parts for t in p[1]]
    split = {}
    if trace is not None:
        time.sleep(0.5)  # the core and the driver write their traces once idle
        split = trace_split(trace, start, max(done), done)
    return tokens / max(done), tokens, split


def trace_split(path: Path, t0: float, wall: float, done: list[float]) -> dict:
    """A burst read off the engine's step trace (TPSERVE_STEP_TRACE), in seconds from the
    client's start: when requests reached the driver's engine bridge and the core, when the
    core stepped, how long it sat idle in between, and the steps that ran while requests
    were still arriving."""
    from tpserve.engine.step_trace import read

    core = read(str(path), t0)
    drv = read(str(path) + ".driver", t0)

    def times(rows: list[dict], kind: str) -> list[float]:
        return [r["t"] - t0 for r in rows if r["kind"] == kind and r["t"] - t0 <= wall + 1]

    steps = [r for r in core if r["kind"] == "step" and r["t"] - t0 <= wall]
    if not steps:
        return {}
    arrive, add = times(drv, "arrive"), times(core, "add")
    first, end = steps[0]["t"] - t0, max(r["t"] + r["dt"] for r in steps) - t0
    busy = sum(r["dt"] for r in steps)
    last_add = add[-1] if add else first
    ramp = [r for r in steps if r["t"] - t0 <= last_add]
    nan = float("nan")
    return {"first_arrive": arrive[0] if arrive else nan,
            "last_arrive": arrive[-1] if arrive else nan,
            "first_add": add[0] if add else nan, "last_add": last_add, "adds": len(add),
            "first_step": first, "last_step_end": end, "steps": len(steps),
            "idle": (end - first) - busy, "wait": sum(r["wait"] for r in steps),
            "ramp_steps": len(ramp),
            "ramp_tokens": sum(r["tokens"] for r in ramp) / max(len(ramp), 1),
            "prefill_steps": sum(r["prefill"] for r in steps),
            "last_done": max(done) if done else nan}


def timeline(samples: list, done: list[float], t0: float, steps0: float) -> dict:
    """Seconds from the burst's start: the first and last sight of a new engine step (the
    gauges reach /metrics with each poll, so within a step or two), first and last response."""
    moved = [t - t0 for t, steps in samples if steps > steps0]
    last = max(steps for _, steps in samples) if samples else steps0
    settled = [t - t0 for t, steps in samples if steps == last]
    return {"first_step_s": moved[0] if moved else float("nan"),
            "last_step_s": settled[0] if settled else float("nan"),
            "first_done_s": min(done) - t0, "last_done_s": max(done) - t0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(url: str, args, vocab: int, label: str = "this",
                  trace: Path | None = None, pool=None) -> dict:
    rng = random.Random(0)
    res: dict = {}
    names = getattr(args, "lora_names", [])
    adapters = [adapter_of(i, names, args.lora_requests) for i in range(max(1, 2 * len(names)))]
    async with session(8) as client:
        for _ in range(2):  # warm the path (first requests pay lazy initialisation)
            await stream_once(client, url, prompt(args.prompt_len, rng, vocab), 16,
                              adapters[0])
        ttfts, gaps = [], []
        for _ in range(3):
            t, g = await stream_once(client, url, prompt(args.prompt_len, rng, vocab),
                                     args.new_tokens, adapters[0])
            ttfts.append(t)
            gaps.extend(g)
        res["ttft_ms"] = statistics.median(ttfts) * 1e3
        res["itl_median_ms"] = statistics.median(gaps) * 1e3
        res["itl_p99_ms"] = pct(gaps, 0.99) * 1e3
        res["stream_tokens"] = len(gaps) + 3
        if args.long:
            for n in (1024, 4096, 8000):
                if n + 64 > args.max_total_tokens:
                    continue
                t, g = await stream_once(client, url, prompt(n, rng, vocab), 64)
                res[f"long{n}"] = (t * 1e3, statistics.median(g) * 1e3)
    if args.arrivals:
        async with session(64) as client:
            res["arrivals"] = await stream_with_arrivals(client, url, args, vocab, rng)
    for c in args.concurrency:
        profiler = (Profiler(args.py_spy, args.logs, f"{label}_{c}")
                    if args.py_spy and c == max(args.concurrency) else None)
        tps, toks, where = await throughput(url, c, args.prompt_len, args.new_tokens, vocab,
                                            profiler, trace, adapters)
        res[f"tps_{c}"] = tps
        res[f"toks_{c}"] = toks
        res[f"split_{c}"] = where
    if pool is not None:
        for c in args.concurrency:
            tail = (TailProfiler(args.py_spy, args.logs, f"{label}_{c}", args.py_spy_tail)
                    if args.py_spy and args.py_spy_tail and c == max(args.concurrency)
                    else None)
            res[f"spread_{c}"], _, res[f"spread_trace_{c}"] = await asyncio.to_thread(
                spread_throughput, pool, args.client_procs, url, c, args.prompt_len,
                args.new_tokens, vocab, trace, tail, adapters)
    return res


async def stream_with_arrivals(client, url: str, args, vocab: int, rng) -> dict:
    """One stream of args.new_tokens while a new request (args.prompt_len tokens, 16 new)
    arrives every args.arrivals ms, as on a server whose users come and go: each arrival
    is prefilled in a step next to the running ones (a mixed step). The stream's gaps
    between tokens, and the arrivals' time to first token."""
    arrivals: list = []

    async def arrive():
        while True:
            await asyncio.sleep(args.arrivals / 1e3)
            arrivals.append(asyncio.create_task(
                stream_once(client, url, prompt(args.prompt_len, rng, vocab), 16)))

    sender = asyncio.create_task(arrive())
    try:
        _, gaps = await stream_once(client, url, prompt(args.prompt_len, rng, vocab),
                                    args.new_tokens)
    finally:
        sender.cancel()
    done = await asyncio.gather(*arrivals)
    return {"itl_median_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3, "itl_mean_ms": statistics.fmean(gaps) * 1e3,
            "arrivals": len(done),
            "arrival_ttft_ms": statistics.median(t for t, _ in done) * 1e3 if done else 0.0}


def commit_of(tree: Path) -> str:
    if (tree / "COMMIT").exists():  # an exported tree (git archive) names its commit
        return (tree / "COMMIT").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "?"


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except FileNotFoundError:
        gpu = []
    return f"{len(gpu)}x {gpu[0]}" if gpu else f"CPU ({os.cpu_count()} cores, {platform.machine()})"


def table(rows: list[tuple[str, str, float, dict]], args) -> str:
    cols = ["tree", "commit", "launch to ready s", "TTFT ms", "ITL median ms", "ITL p99 ms"]
    cols += [f"{c} req tok/s" for c in args.concurrency]
    spread = args.client_procs > 1
    if spread:
        cols += [f"{c} req tok/s, {args.client_procs} client processes"
                 for c in args.concurrency]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    watch_ms = 1e3 * watch_s(args.logs if args.step_trace else None)
    for label, commit, ready, r in rows:
        vals = [label, commit, f"{ready:.1f}", f"{r['ttft_ms']:.1f}", f"{r['itl_median_ms']:.2f}",
                f"{r['itl_p99_ms']:.2f}"] + [f"{r[f'tps_{c}']:,.0f}" for c in args.concurrency]
        if spread:
            vals += [f"{r[f'spread_{c}']:,.0f}" for c in args.concurrency]
        lines.append("| " + " | ".join(vals) + " |")
    lines += ["", "Where each burst's time went (engine gauges on /metrics, differences across "
              "the burst): the engine core's steps, the share of the wall time it was inside a "
              "step, per step the time waiting for the device and the host's own time, and "
              "the driver's share spent processing outputs (detokenization, stop strings); "
              "then, in seconds from the burst's start, when the core was seen stepping (the "
              "step counter on /metrics, sampled every "
              f"{watch_ms:.0f} ms) and when the first and last "
              "responses arrived.", "",
              "| tree | requests | wall s | steps | prefill steps | tokens/step | core busy % | "
              "ms/step | device wait ms/step | host ms/step | driver processing % | "
              "core stepping s | responses s |",
              "|" + " --- |" * 13]
    for label, _, _, r in rows:
        for c in args.concurrency:
            w = r.get(f"split_{c}")
            if w:
                lines.append(f"| {label} | {c} | {w['wall_s']:.2f} | {w['steps']:.0f} | "
                             f"{w['prefill_steps']:.0f} | {w['tokens_per_step']:.0f} | "
                             f"{w['core_busy_pct']:.0f} | {w['step_ms']:.2f} | "
                             f"{w['device_wait_ms']:.2f} | {w['host_ms']:.2f} | "
                             f"{w['driver_process_pct']:.0f} | "
                             f"{w['first_step_s']:.2f}-{w['last_step_s']:.2f} | "
                             f"{w['first_done_s']:.2f}-{w['last_done_s']:.2f} |")
    traced = [(label, c, r[f"split_{c}"]["trace"]) for label, _, _, r in rows
              for c in args.concurrency if r.get(f"split_{c}", {}).get("trace")]
    traced += [(f"{label}, {args.client_procs} client processes", c, r[f"spread_trace_{c}"])
               for label, _, _, r in rows for c in args.concurrency
               if r.get(f"spread_trace_{c}")]
    if traced:
        lines += ["", "The same bursts on the engine's step trace (TPSERVE_STEP_TRACE), seconds "
                  "from the client's start: requests reaching the driver's engine bridge "
                  "(first-last), batches the core admitted (first-last, count), the core's "
                  "steps (first start - last end), the core's idle time between its first "
                  "and last step, the steps that ran while requests were still being admitted "
                  "(count, mean tokens), and the last response.", "",
                  "| tree | requests | arrivals s | core admissions s (batches) | steps s | "
                  "steps | core idle s | steps while admitting (tokens/step) | last response s |",
                  "|" + " --- |" * 9]
        for label, c, t in traced:
            lines.append(f"| {label} | {c} | {t['first_arrive']:.3f}-{t['last_arrive']:.3f} | "
                         f"{t['first_add']:.3f}-{t['last_add']:.3f} ({t['adds']}) | "
                         f"{t['first_step']:.3f}-{t['last_step_end']:.3f} | {t['steps']} | "
                         f"{t['idle']:.3f} | {t['ramp_steps']} ({t['ramp_tokens']:.0f}) | "
                         f"{t['last_done']:.3f} |")
    if args.arrivals:
        lines += ["", f"One stream of {args.new_tokens} tokens while a request of "
                  f"{args.prompt_len} prompt tokens (16 new) arrives every {args.arrivals:g} ms:",
                  "", "| tree | arrivals | stream ITL median ms | ITL mean ms | ITL p99 ms | "
                  "arrivals' TTFT median ms |", "| --- | --- | --- | --- | --- | --- |"]
        for label, _, _, r in rows:
            a = r["arrivals"]
            lines.append(f"| {label} | {a['arrivals']} | {a['itl_median_ms']:.2f} | "
                         f"{a['itl_mean_ms']:.2f} | {a['itl_p99_ms']:.2f} | "
                         f"{a['arrival_ttft_ms']:.1f} |")
    if args.long:
        lines += ["", "| tree | prompt tokens | TTFT ms | ITL median ms |", "| --- | --- | --- | --- |"]
        for label, _, _, r in rows:
            for n in (1024, 4096, 8000):
                if f"long{n}" in r:
                    t, g = r[f"long{n}"]
                    lines.append(f"| {label} | {n} | {t:.0f} | {g:.2f} |")
    return "\n".join(lines)


def lora_launch_flags(args, model: Path) -> list[str]:
    """--lora N: write N random adapters beside the model, note their names in
    args.lora_names (the requests name them) and return the launch flags that load them."""
    args.lora_names = []
    if not args.lora:
        return []
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lora_adapters import random_adapters

    pairs = random_adapters(model, args.lora, args.lora_rank, model.parent / "lora")
    args.lora_names = [name for name, _ in pairs]
    return ["--lora-modules", *(f"{n}={p}" for n, p in pairs),
            "--max-lora-rank", str(args.lora_rank), "--max-loras", str(args.lora)]


def launch_options(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark that launches `tpserve launch` takes last."""
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--launch-args", nargs=argparse.REMAINDER, default=[],
                    help="further `tpserve launch` flags (last on the line)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", type=Path,
                    default=ROOT / "tests/data/configs/Meta-Llama-3-8B.json")
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=PATH of a checkout to launch (repeatable); default: this one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--long", action="store_true", help="also 1k/4k/8k-token prompts")
    ap.add_argument("--arrivals", type=float, default=0.0, metavar="MS",
                    help="also one stream while a new request arrives every MS ms")
    ap.add_argument("--step-trace", action="store_true",
                    help="trace the engine's steps (TPSERVE_STEP_TRACE) and split each burst "
                         "by it (the trees must have tpserve/engine/step_trace.py)")
    ap.add_argument("--client-procs", type=int, default=1, metavar="N",
                    help="also send each burst from N client processes started together "
                         "(one process's own sending delays the server's first request)")
    ap.add_argument("--py-spy", metavar="PATH",
                    help="py-spy binary: profile the core and driver actors in the largest burst")
    ap.add_argument("--py-spy-tail", type=float, default=0.0, metavar="SECONDS",
                    help="with --py-spy and --client-procs: also profile the GIL holders of "
                         "the driver and core for 1 s from SECONDS after the start of the "
                         "largest burst from several processes (its last steps)")
    ap.add_argument("--lora", type=int, default=0, metavar="N",
                    help="launch with N random LoRA adapters (benchmarks/lora_adapters.py; "
                         "Llama-shaped configs) and name them in the requests")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-requests", default="all", choices=["all", "half", "none"],
                    help="with --lora: which requests name an adapter, round robin over them "
                         "(half: every other one, so steps mix adapter and base rows)")
    launch_options(ap)
    args = ap.parse_args()
    if args.py_spy_tail and not (args.py_spy and args.client_procs > 1):
        ap.error("--py-spy-tail profiles the burst from several processes: it needs --py-spy "
                 "PATH and --client-procs 2 or more")
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    vocab = json.loads(args.model_config.read_text())["vocab_size"]
    model = make_model_dir(args.model_config, Path(tempfile.mkdtemp()) / "model")
    lora_flags = lora_launch_flags(args, model)
    args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    pool = None
    if args.client_procs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.client_procs,
                                   mp_context=multiprocessing.get_context("spawn"))
        for f in [pool.submit(time.time) for _ in range(args.client_procs)]:
            f.result()  # the processes are up (aiohttp imported) before any burst
    for label, spec in trees:
        # label=PATH or label=PATH::--flag --flag NAME=VALUE: this tree's own extra launch
        # flags and environment variables (e.g. TPSERVE_TUNE_GEMMS=0 for an A/B of one tree).
        path, _, flags = spec.partition("::")
        tree = Path(path).resolve()
        env = dict(f.split("=", 1) for f in flags.split() if not f.startswith("-") and "=" in f)
        flags = " ".join(f for f in flags.split() if f.startswith("-") or "=" not in f)
        srv = Server(tree, model, args, args.logs / f"serve_{label}.log",
                     flags.split() + lora_flags, env)
        try:
            ready = srv.wait_ready(args.ready_timeout)
            print(f"[{label}] ready in {ready:.1f}s", flush=True)
            res = asyncio.run(measure(srv.url, args, vocab, label, srv.trace, pool))
            print(f"[{label}] {res}", flush=True)
            extra = " ".join([flags.strip(), *(f"{k}={v}" for k, v in env.items())]).strip()
            rows.append((label + (f" ({extra})" if extra else ""), commit_of(tree),
                         ready, res))
        finally:
            srv.stop()
    if pool is not None:
        pool.shutdown()
    text = table(rows, args)
    print(text)
    if args.out:
        head = (f"\nMachine: {machine()}; {datetime.date.today().isoformat()}; "
                f"tp {args.tp}, {args.dtype}, model {args.model_config.stem} (random weights), "
                f"prompt ~{args.prompt_len}, {args.new_tokens} new tokens, "
                f"--max-batch-size {args.max_batch_size}, launch flags {args.launch_args}"
                + (f", {args.lora} random LoRA adapters of rank {args.lora_rank} named by "
                   f"{args.lora_requests} requests" if args.lora else "") + "\n\n")
        with open(args.out, "a") as f:
            f.write(head + text + "\n")


if __name__ == "__main__":
    main()
