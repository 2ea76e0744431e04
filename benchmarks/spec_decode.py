"""Speculative decoding (--speculative ngram) side by side on the CPU: the same greedy
requests on two in-process engines, without and with speculation, alternated in one run.
Prints a table and, with --write, appends it to docs/benchmarks.md.

No trained model that copies its context is at hand, so two random Llamas stand in:
"tiny" (hidden 64, 2 layers, vocab 301, the tests' checkpoint), whose greedy output falls
into loops, and "small" (hidden 256, 4 layers, vocab 512), whose greedy output does not
repeat. Workloads: "repeat" (tiny): 48 random ids followed by the model's own 96-token
greedy continuation, so the answer goes on copying runs of its prompt, as an edit or a
quoting answer does with a real model; "random" (tiny): 48 random ids, repeats only where
the model loops on its own output; "miss" (small): 48 random ids, where the drafts miss,
to show what speculation costs when it does not help.

    python benchmarks/spec_decode.py [--requests 8] [--new-tokens 64] [--rounds 6] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


MODELS = {
    "tiny": {},
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}


def checkpoint(name: str, root: Path) -> Path:
    from tiny_models import llama_config, save_model

    return save_model(llama_config(max_position_embeddings=1024, **MODELS[name]), root / name)


def workloads(model: str, engine, n: int, rng: random.Random) -> dict[str, list[list[int]]]:
    from engine_utils import greedy_ids

    vocab = engine.hf_config.vocab_size
    rand = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(n)]
    if model == "small":
        return {"miss": rand}
    seeds = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(n)]
    heads = greedy_ids(engine, seeds, 96)
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
    """Fastest seconds per setting over rounds (the least disturbed by other jobs on a
    shared machine), the order of the settings swapped every round; steps per round."""
    secs: dict[str, list[float]] = {k: [] for k in engines}
    steps: dict[str, float] = {}
    spec = engines["on"]
    before = spec.counters()
    names = list(engines)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            e = engines[name]
            s0 = e.counters()["steps"]
            s, made = timed(e, prompts, new, batched)
            secs[name].append(s)
            steps[name] = e.counters()["steps"] - s0
    after = spec.counters()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"seconds": {k: min(v) for k, v in secs.items()}, "tokens": made, "steps": steps,
            "acceptance": accepted / drafted if drafted else 0.0}


def main() -> None:
    from engine_utils import make_engine

    from tpserve.config import SpeculativeConfig
    from tpserve.engine.request import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    rows, same = [], True
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        for model in MODELS:
            path = checkpoint(model, Path(d))
            # One core per shard: the machine is shared, and more threads than free cores
            # make a CPU step many times slower.
            kw = dict(block_size=16, num_blocks=2048, max_model_len=1024,
                      max_batch_tokens=2048, cpus_per_shard=1, local=True)
            engines = {"off": make_engine(path, 1, **kw),
                       "on": make_engine(path, 1, speculative=SpeculativeConfig("ngram", k),
                                         **kw)}
            for e in engines.values():  # warm
                e.generate([[5, 6, 7, 8] * 8], SamplingParams(max_new_tokens=8))
            loads = workloads(model, engines["off"], args.requests, random.Random(0))
            for name, prompts in loads.items():
                outs = [[o.generated_text for o in engines[s].generate(prompts, greedy)]
                        for s in ("off", "on")]
                same &= outs[0] == outs[1]
                for batched in (False, True):
                    m = measure(engines, prompts, args.new_tokens, batched, args.rounds)
                    rows.append((model, name, batched, m))
            for e in engines.values():
                e.shutdown()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = (f"### Speculative decoding, n-gram lookup ({when}; {platform.machine()} CPU, "
             f"{os.cpu_count()} cores shared with other jobs, torch {torch.__version__})\n\n"
             f"`python benchmarks/spec_decode.py --requests {args.requests} --new-tokens "
             f"{args.new_tokens} --rounds {args.rounds}`: in-process engine, tp = 1, float32, "
             f"one core, `--num-speculative-tokens {k}`, n-gram 3 down to 1; "
             f"{args.requests} greedy requests of {args.new_tokens} new tokens, one after "
             f"another (one stream) or all at once (batch); the fastest of {args.rounds} rounds, "
             f"off and on alternated (steps: engine steps per round, exact). Random Llamas stand in for a real model: tiny (hidden "
             f"64, 2 layers, vocab 301), whose greedy output loops, and small (hidden 256, 4 "
             f"layers, vocab 512), whose output does not repeat. repeat: 48 random ids plus the "
             f"tiny model's own 96-token greedy continuation, so the answer copies runs of "
             f"the prompt; random: 48 random ids (tiny: drafts come from its own loops); "
             f"miss: 48 random ids on the small model, where drafts are proposed and "
             f"rejected. Outputs identical with and without: {same}. ms/token: wall time "
             f"over the tokens made (a batch: all its requests' tokens). CPU times are "
             f"context only; the ratio is the result.\n\n"
             "| model | workload | requests | acceptance | steps off / on | off: ms/token | "
             "on: ms/token | off: tokens/s | on: tokens/s | speed-up |\n"
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for model, name, batched, m in rows:
        off, on, tok = m["seconds"]["off"], m["seconds"]["on"], m["tokens"]
        table += (f"| {model} | {name} | {'batch' if batched else 'one stream'} | "
                  f"{m['acceptance']:.0%} | {m['steps']['off']:.0f} / {m['steps']['on']:.0f} | "
                  f"{1e3 * off / tok:.2f} | {1e3 * on / tok:.2f} | "
                  f"{tok / off:.0f} | {tok / on:.0f} | {off / on:.2f}x |\n")
    print(table)
    if args.write:
        doc = ROOT / "docs" / "benchmarks.md"
        doc.write_text(doc.read_text().rstrip() + "\n\n" + table)


if __name__ == "__main__":
    main()
