"""Side-by-side serving throughput on the CPU: tpserve's engine vs transformers generate on
the same checkpoint and the same greedy workload. Ratios only (absolute CPU times depend on
the machine); prints a table and writes it into docs/benchmarks.md.

    python benchmarks/cpu_serving.py [--requests 16] [--new-tokens 64] [--hidden 512]
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
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def build_checkpoint(hidden: int, layers: int, out: Path) -> Path:
    from tiny_models import llama_config, save_model

    cfg = llama_config(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                       vocab_size=4096, max_position_embeddings=1024)
    return save_model(cfg, out)


def prompts(n: int) -> list[str]:
    base = ["The quick brown fox", "Hello world, this is", "A paged cache stores keys",
            "Ray actors hold one shard each and"]
    return [f"{base[i % len(base)]} {i}" for i in range(n)]


def bench_transformers(path: Path, ps: list[str], new: int, batched: bool) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # warm up, as the engine is warmed up
        model.generate(**tok(ps[:2], return_tensors="pt", padding=True),
                       **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    t0 = time.perf_counter()
    with torch.no_grad():
        if batched:
            enc = tok(ps, return_tensors="pt", padding=True)
            model.generate(**enc, **kw)
        else:
            for p in ps:
                model.generate(**tok(p, return_tensors="pt"), **kw)
    return len(ps) * new / (time.perf_counter() - t0)


def bench_tpserve(path: Path, ps: list[str], new: int, tp: int) -> float:
    from engine_utils import make_engine

    from tpserve.engine.request import SamplingParams

    engine = make_engine(path, tp, local=tp == 1, block_size=16, num_blocks=2048,
                         max_model_len=1024, max_batch_tokens=2048,
                         cpus_per_shard=max(1, (os.cpu_count() or 1) // tp))
    try:
        engine.generate(ps[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm
        t0 = time.perf_counter()
        engine.generate(ps, SamplingParams(max_new_tokens=new, ignore_eos=True))
        return len(ps) * new / (time.perf_counter() - t0)
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ps = prompts(args.requests)
    with tempfile.TemporaryDirectory() as d:
        path = build_checkpoint(args.hidden, args.layers, Path(d) / "m")
        rows = [("transformers generate, one request at a time",
                 bench_transformers(path, ps, args.new_tokens, batched=False)),
                ("transformers generate, one padded batch",
                 bench_transformers(path, ps, args.new_tokens, batched=True))]
        if any(tp > 1 for tp in args.tp):
            import ray

            ray.init(num_cpus=max(args.tp) * 1, include_dashboard=False, log_to_driver=False)
        for tp in args.tp:
            where = "in-process" if tp == 1 else f"{tp} Ray shard actors"
            rows.append((f"tpserve engine, tp={tp} ({where}), continuous batching",
                         bench_tpserve(path, ps, args.new_tokens, tp)))
    base = rows[1][1]
    when = datetime.date.today().isoformat()
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"
    head = (f"### CPU serving throughput ({when}; {machine})\n\nRandom Llama, hidden "
            f"{args.hidden}, {args.layers} layers, float32; {args.requests} requests x "
            f"{args.new_tokens} greedy tokens. Ratio = tokens/s over transformers' padded "
            "batch, measured side by side in one run.\n\n| system | tokens/s | ratio |\n"
            "| --- | --- | --- |\n")
    table = head + "".join(f"| {n} | {v:.1f} | {v / base:.2f} |\n" for n, v in rows)
    print(table)
    if args.write:
        doc = ROOT / "docs" / "benchmarks.md"
        text = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
        doc.write_text(text.rstrip() + "\n\n" + table)


if __name__ == "__main__":
    main()
