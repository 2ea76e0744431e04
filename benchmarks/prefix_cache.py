"""Prefix caching side by side on the CPU: requests that share a long system prompt, served
with and without --prefix-caching in one run (same checkpoint, same requests). Prints a
table and, with --write, appends it to docs/benchmarks.md.

    python benchmarks/prefix_cache.py [--requests 16] [--system-tokens 384] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from cpu_serving import build_checkpoint
    from engine_utils import make_engine

    from tpserve.engine.request import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    system = [(7 * j) % 4000 + 3 for j in range(args.system_tokens)]
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = build_checkpoint(512, 8, Path(d) / "m")
        outputs = {}
        for cached in (False, True):
            engine = make_engine(path, 1, local=True, block_size=16, num_blocks=4096,
                                 max_model_len=1024, max_batch_tokens=2048,
                                 cpus_per_shard=os.cpu_count() or 1, prefix_caching=cached)
            engine.generate([prompts[0][:32]], SamplingParams(max_new_tokens=2))  # warm
            t0 = time.perf_counter()
            # Arriving one after another, as a chat service sees them.
            outputs[cached] = [engine.generate([p], params)[0].generated_text for p in prompts]
            seconds = time.perf_counter() - t0
            hits = getattr(engine.scheduler.blocks, "hits", 0)
            rows.append((cached, seconds, hits))
            engine.shutdown()
    same = outputs[False] == outputs[True]
    base = rows[0][1]
    when = datetime.date.today().isoformat()
    table = (f"### Prefix caching ({when}; {platform.machine()} CPU, {os.cpu_count()} cores, "
             f"torch {torch.__version__})\n\nRandom Llama, hidden 512, 8 layers, float32, "
             f"tp = 1; {args.requests} requests one after another, each a shared "
             f"{args.system_tokens}-token system prompt + 3 own tokens, {args.new_tokens} new "
             f"tokens each. Outputs identical with and without: {same}.\n\n"
             "| prefix caching | seconds | speed-up | blocks reused |\n| --- | --- | --- | --- |\n")
    table += "".join(f"| {'on' if c else 'off'} | {s:.2f} | {base / s:.2f}x | {h} |\n"
                     for c, s, h in rows)
    print(table)
    if args.write:
        doc = ROOT / "docs" / "benchmarks.md"
        doc.write_text(doc.read_text().rstrip() + "\n\n" + table)


if __name__ == "__main__":
    main()
