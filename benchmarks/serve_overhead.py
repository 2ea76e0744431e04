"""What Ray Serve's proxy and ingress add in front of one replica: `tpserve launch` as the
direct server (--replicas 1) against the same engine as one Serve replica
(--min-replicas 1 --max-replicas 1), measured from an HTTP client on the same machine:
- per request: latency of /generate with max_new_tokens=1 (sequential, median and p90);
- per streamed token: gaps between /generate_stream tokens (median);
- concurrent: tokens/s of N concurrent /generate requests.

On the CPU with the embedded model (what docs/benchmarks.md reports):
    python benchmarks/serve_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from server_process import launched  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog while seven wizards hum"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def request_latency(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post(url + "/generate", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 1}})
        r.raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


async def token_gaps(client: httpx.AsyncClient, url: str, streams: int, new: int) -> list[float]:
    gaps: list[float] = []
    for _ in range(streams):
        times = []
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": new, "ignore_eos": True}}
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data:") and json.loads(line[5:]).get("token"):
                    times.append(time.perf_counter())
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


async def concurrent(client: httpx.AsyncClient, url: str, n: int, new: int) -> float:
    async def one(i: int) -> int:
        r = await client.post(url + "/generate", json={
            "inputs": f"{i} {PROMPT}", "parameters": {"max_new_tokens": new,
                                                      "ignore_eos": True, "details": True}})
        r.raise_for_status()
        return r.json()["details"]["generated_tokens"]

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i) for i in range(n)]))
    return tokens / (time.perf_counter() - t0)


async def measure(url: str, args) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        await request_latency(client, url, 5)  # warm both paths
        lat = await request_latency(client, url, args.requests)
        gaps = await token_gaps(client, url, args.streams, args.new_tokens)
        tps = await concurrent(client, url, args.concurrency, args.new_tokens)
    return {"request_ms": statistics.median(lat) * 1e3, "request_p90_ms": pct(lat, 0.9) * 1e3,
            "gap_ms": statistics.median(gaps) * 1e3, "gap_p90_ms": pct(gaps, 0.9) * 1e3,
            "tokens_per_s": tps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--streams", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--extra", default="", help="more launch flags, space-separated")
    args = p.parse_args()
    base = ["--device", "cpu", "--no-dashboard", *args.extra.split()]
    variants = {"direct (--replicas 1)": [],
                "Serve, 1 replica": ["--min-replicas", "1", "--max-replicas", "1"]}
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, flags in variants.items():
            with launched(base + flags, Path(logs) / "server.log") as url:
                results[name] = asyncio.run(measure(url, args))
            print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    d, s = results["direct (--replicas 1)"], results["Serve, 1 replica"]
    print("| path | request (max_new_tokens=1), median / p90 | streamed token gap, median / p90 "
          f"| {args.concurrency} concurrent x {args.new_tokens} tokens |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['request_ms']:.1f} / {r['request_p90_ms']:.1f} ms | "
              f"{r['gap_ms']:.2f} / {r['gap_p90_ms']:.2f} ms | {r['tokens_per_s']:.0f} tokens/s |")
    print(f"| Serve adds | {s['request_ms'] - d['request_ms']:+.1f} ms per request | "
          f"{s['gap_ms'] - d['gap_ms']:+.2f} ms per token | "
          f"{100 * (s['tokens_per_s'] / d['tokens_per_s'] - 1):+.0f}% |")


if __name__ == "__main__":
    main()
