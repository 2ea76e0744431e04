"""The strongest transformers figure for one stream, measured in the same run as tpserve:
`generate` with a static cache and `torch.compile` at batch 1 (and eager, for reference), on
the same model shape with random weights. Prints a table and appends it to --out.

    python benchmarks/transformers_bench.py --model-config tests/data/configs/Meta-Llama-3-8B.json \
        --out results.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def per_token_ms(model, prompt_len: int, new: int, compiled: bool) -> float:
    """ms per generated token after the first (the first one carries the prefill)."""
    ids = torch.randint(1000, 30000, (1, prompt_len), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=new, pad_token_id=0)
    if compiled:
        kw["cache_implementation"] = "static"

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, **{**kw, "min_new_tokens": n})
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(2):  # compile / capture, then warm
        run(new)
    full, first = min(run(new) for _ in range(3)), min(run(1) for _ in range(3))
    return (full - first) / (new - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", type=Path,
                    default=ROOT / "tests/data/configs/Meta-Llama-3-8B.json")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**json.loads(args.model_config.read_text()))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    rows = [("eager", per_token_ms(model, args.prompt_len, args.new_tokens, False))]
    # With a static cache, generate compiles the decoding forward itself (CUDA graphs
    # included); compiling model.forward by hand on top of that breaks its graph capture.
    rows.append(("static cache + torch.compile", per_token_ms(model, args.prompt_len,
                                                              args.new_tokens, True)))
    lines = ["| transformers, batch 1 | ms/token |", "| --- | --- |"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\nMachine: 1x {torch.cuda.get_device_name()}; "
                    f"{datetime.date.today().isoformat()}; transformers {transformers.__version__},"
                    f" torch {torch.__version__}; {args.model_config.stem} random bf16 weights, "
                    f"prompt {args.prompt_len}, {args.new_tokens} new tokens\n\n{text}\n")


if __name__ == "__main__":
    main()
