"""Speculative decoding (--speculative ngram) side by side on the CPU: the same greedy
requests on two in-process engines, without and with speculation, alternated in one run.
Prints a table and, with --write, appends it to docs/benchmarks.md.

Two workloads. "repeat": each prompt is random ids followed by the model's own greedy
continuation of them (a random model's greedy output falls into loops), so the answer
repeats runs of its prompt, as an edit or a quoting answer does with a real model. "random":
random prompts, whose answers repeat only where the random model loops on its own output
(the acceptance rate column says how often the drafts hit).

    python benchmarks/spec_decode.py [--requests 8] [--new-tokens 64] [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def workloads(engine, n: int, head: int, rng: random.Random) -> dict[str, list[list[int]]]:
    from engine_utils import greedy_ids

    rand = [[rng.randrange(3, 4000) for _ in range(48)] for _ in range(n)]
    seeds = [[rng.randrange(3, 4000) for _ in range(48)] for _ in range(n)]
    heads = greedy_ids(engine, seeds, head)
    return {"repeat": [s + h for s, h in zip(seeds, heads, strict=True)], "random": rand}


def timed(engine, prompts: list[list[int]], new: int, batched: bool) -> tuple[float, int]:
    """Seconds to run the prompts (all at once, or one after another) and tokens made."""
    from tpserve.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    groups = [prompts] if batched else [[p] for p in prompts]
    made = 0
    for group in groups:
        made += sum(ev.generated_tokens for ev in engine.generate(group, params))
    return time.perf_counter() - t0, made


def measure(engines: dict, prompts, new: int, batched: bool, rounds: int) -> dict:
    """Median seconds per setting over rounds, settings alternated within each round."""
    secs: dict[str, list[float]] = {k: [] for k in engines}
    spec = engines["on"]
    before = spec.counters()
    for _ in range(rounds):
        for name, e in engines.items():
            s, made = timed(e, prompts, new, batched)
            secs[name].append(s)
    after = spec.counters()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"seconds": {k: statistics.median(v) for k, v in secs.items()}, "tokens": made,
            "acceptance": accepted / drafted if drafted else 0.0}


def main() -> None:
    from cpu_serving import build_checkpoint
    from engine_utils import make_engine

    from tpserve.config import SpeculativeConfig
    from tpserve.engine.request import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    rows, same = [], True
    with tempfile.TemporaryDirectory() as d:
        path = build_checkpoint(512, 8, Path(d) / "m")
        kw = dict(block_size=16, num_blocks=2048, max_model_len=1024, max_batch_tokens=2048,
                  cpus_per_shard=os.cpu_count() or 1, local=True)
        engines = {"off": make_engine(path, 1, **kw),
                   "on": make_engine(path, 1, speculative=SpeculativeConfig("ngram", k), **kw)}
        for e in engines.values():  # warm
            e.generate([[5, 6, 7, 8] * 8], SamplingParams(max_new_tokens=8))
        loads = workloads(engines["off"], args.requests, 96, random.Random(0))
        for name, prompts in loads.items():
            outs = [engines[s].generate(prompts, SamplingParams(max_new_tokens=args.new_tokens,
                                                                ignore_eos=True))
                    for s in ("off", "on")]
            same &= [o.generated_text for o in outs[0]] == [o.generated_text for o in outs[1]]
            for batched in (False, True):
                m = measure(engines, prompts, args.new_tokens, batched, args.rounds)
                rows.append((name, batched, m))
        for e in engines.values():
            e.shutdown()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = (f"### Speculative decoding, n-gram lookup ({when}; {platform.machine()} CPU, "
             f"{os.cpu_count()} cores shared with other jobs, torch {torch.__version__})\n\n"
             f"`python benchmarks/spec_decode.py --requests {args.requests} --new-tokens "
             f"{args.new_tokens} --rounds {args.rounds}`: random Llama (hidden 512, 8 layers, "
             f"vocab 4096), float32, tp = 1, in-process engine, `--num-speculative-tokens {k}`"
             f", n-gram 3 down to 1. {args.requests} greedy requests of {args.new_tokens} new "
             f"tokens, one after another (one stream) or all at once (batch); median of "
             f"{args.rounds} alternated rounds. \"repeat\": prompts of 48 random ids plus the "
             f"model's own 96-token greedy continuation, which loops, so the answer copies "
             f"runs of the prompt (a random model stands in for a real one asked to repeat "
             f"or edit a text); \"random\": 48 random ids. Outputs identical with and "
             f"without: {same}. ms/token: wall time over the tokens made (a batch: all its requests' "
             f"tokens). CPU times are context only; the ratio is the result.\n\n"
             "| workload | requests | acceptance | off: ms/token | on: ms/token | off: "
             "tokens/s | on: tokens/s | speed-up |\n| --- | --- | --- | --- | --- | --- | --- "
             "| --- |\n")
    for name, batched, m in rows:
        off, on, tok = m["seconds"]["off"], m["seconds"]["on"], m["tokens"]
        # One stream: ms per token of a request; batch: ms per step-token of the batch.
        table += (f"| {name} | {'batch' if batched else 'one stream'} | "
                  f"{m['acceptance']:.0%} | {1e3 * off / tok:.2f} | {1e3 * on / tok:.2f} | "
                  f"{tok / off:.0f} | {tok / on:.0f} | {off / on:.2f}x |\n")
    print(table)
    if args.write:
        doc = ROOT / "docs" / "benchmarks.md"
        doc.write_text(doc.read_text().rstrip() + "\n\n" + table)


if __name__ == "__main__":
    main()
