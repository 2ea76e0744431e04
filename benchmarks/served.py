"""The served path as a user sees it: `tpserve launch` in a subprocess (driver, Ray shard
actors, HTTP), measured from an HTTP client: single-stream time to first token and the gaps
between streamed tokens (median, p99), then tokens/s for N concurrent /generate requests.

On one H200 (Llama-3-8B shape, random bf16 weights, nothing downloaded):
    python benchmarks/served.py --out docs/benchmarks.md
On the CPU with a tiny model directory (checks the script itself):
    python benchmarks/served.py --device cpu --model DIR --prompt-tokens 32 --new-tokens 16 \\
        --concurrency 4 --extra=--max-total-tokens=256
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# One H200, Llama-3-8B shape, bf16 (measured; see the README's speed lines).
ROOFLINE_MS = 3.77
TRANSFORMERS_COMPILED_MS = 7.18


def prompt_of(model: Path, n: int) -> str:
    """A prompt of about n tokens for this model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum ".split()
    text, i = "", 0
    while len(tok(text).input_ids) < n:
        text += words[i % len(words)] + " "
        i += 1
    return text


async def one_stream(client, url: str, prompt: str, new: int) -> tuple[float, list[float]]:
    """(time to first token, gaps between tokens) of one /generate_stream request, in s."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new}}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("token"):
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


async def many(client, url: str, prompt: str, new: int, n: int) -> tuple[int, float]:
    """(tokens generated, seconds) for n concurrent /generate requests."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new, "details": True}}

    async def one():
        r = await client.post(url + "/generate", json=body)
        r.raise_for_status()
        return r.json()["details"]["generated_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(n)))
    return sum(counts), time.perf_counter() - t0


async def measure(url: str, prompt: str, args) -> dict:
    import httpx

    res: dict = {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_stream(client, url, prompt, 8)  # warm
        ttfts, gaps, means = [], [], []
        for _ in range(args.streams):
            ttft, g = await one_stream(client, url, prompt, args.new_tokens)
            ttfts.append(ttft)
            gaps += g
            means.append(sum(g) / max(1, len(g)))
        gaps.sort()
        res["ttft_ms"] = statistics.median(ttfts) * 1e3
        res["itl_median_ms"] = statistics.median(gaps) * 1e3
        # Tokens that arrive in bursts (several per long poll) show as tiny gaps: the mean
        # (stream time / tokens) is the rate a user sees either way.
        res["itl_mean_ms"] = statistics.median(means) * 1e3
        res["itl_p99_ms"] = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3
        for n in args.concurrency:
            tokens, seconds = await many(client, url, prompt, args.new_tokens, n)
            res[f"tps_{n}"] = tokens / seconds
    return res


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       text=True).strip()
    except Exception:  # noqa: BLE001 - outside a checkout
        return "unknown"


def main() -> None:
    from server_process import launched

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: Llama-3-8B shape, "
                    "random weights)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "xpu"])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=3, help="single-stream requests to time")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--extra", action="append", default=[],
                    help="extra `tpserve launch` argument (repeat), e.g. --extra=--no-cuda-graphs")
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from engine_step import llama3_dir

            model, dummy = llama3_dir(Path(tmp) / "llama3-8b"), True
        else:
            model, dummy = args.model, not any(args.model.glob("*.safetensors"))
        launch = ["--model", str(model), "--device", args.device,
                  "--max-batch-size", str(max(args.concurrency)),
                  "--max-concurrent-requests", str(max(args.concurrency) + 8)]
        if dummy:
            launch += ["--load-format", "dummy"]
        if args.device != "cpu":
            launch += ["--dtype", "bfloat16"]
        t0 = time.perf_counter()
        with launched(launch + args.extra, Path(tmp) / "server.log", ready_timeout=600) as url:
            ready_s = time.perf_counter() - t0
            res = asyncio.run(measure(url, prompt_of(model, args.prompt_tokens), args))
    lines = [f"\n### served.py, {datetime.date.today()}, commit {commit()}", "",
             f"{args.model or 'Llama-3-8B shape, random bf16 weights'}, {args.device}, "
             f"{args.prompt_tokens} prompt / {args.new_tokens} new tokens, launch args "
             f"{' '.join(args.extra) or '(defaults)'}", "",
             "| what | value |", "| --- | --- |",
             f"| launch to ready | {ready_s:.1f} s |",
             f"| time to first token (median) | {res['ttft_ms']:.1f} ms |",
             f"| single stream, median gap between tokens | {res['itl_median_ms']:.2f} ms |",
             f"| single stream, p99 gap | {res['itl_p99_ms']:.2f} ms |",
             f"| single stream, mean time per token | {res['itl_mean_ms']:.2f} ms |"]
    lines += [f"| {n} concurrent requests | {res[f'tps_{n}']:,.0f} tokens/s |"
              for n in args.concurrency]
    if args.device == "cuda" and args.model is None:
        lines += [f"| roofline per decode step (H200) | {ROOFLINE_MS} ms |",
                  f"| transformers, static cache + compile | {TRANSFORMERS_COMPILED_MS} ms |"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
