#!/usr/bin/env python
"""Train the tiny embedded default model that ``tpserve launch`` serves when no
``--model`` is given.

The model is a small Llama-architecture causal LM trained from scratch on the
English prose of CPython's own reference documentation (``pydoc_data.topics``,
shipped with every CPython install, PSF license), with a byte-level BPE
tokenizer trained on the same text. Everything is offline and deterministic.

Shapes are chosen so the model shards over tp = 1, 2, 4: 8 attention heads,
2 KV heads (replicated at tp = 4), intermediate size divisible by 4.

Usage:
    python scripts/train_default_model.py                 # defaults used for the shipped model
    python scripts/train_default_model.py --steps 200 --out /tmp/m   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time

import numpy as np
import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)
SAMPLE_PROMPTS = ["The default value of", "A function definition", "When an exception is raised"]


def load_corpus() -> list[str]:
    """Return one cleaned document per pydoc topic, in sorted-key order."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        lines = []
        in_grammar = False
        for line in topics[key].splitlines():
            stripped = line.strip()
            # Drop BNF grammar productions (``a ::= b`` and their ``| c`` continuations).
            if "::=" in line:
                in_grammar = True
                continue
            if in_grammar:
                if stripped and line.startswith(" ") and not stripped[0].isalpha():
                    continue
                if stripped and line.startswith("      "):
                    continue
                in_grammar = False
            # Drop reST section underlines such as ******** or ========.
            if stripped and len(set(stripped)) == 1 and stripped[0] in "*=-~^\"'#+":
                continue
            lines.append(line.rstrip())
        text = "\n".join(lines)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if text:
            docs.append(text)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tpserve", "default_model"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=10.0,
                    help="stop training early after this many minutes (0 = no limit)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    docs = load_corpus()
    print(f"corpus: {len(docs)} topics, {sum(map(len, docs))} chars "
          f"(pydoc_data.topics from Python {sys.version.split()[0]})", flush=True)

    tok = train_tokenizer(docs, args.vocab_size)
    hf_tok = wrap_tokenizer(tok)
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    ids: list[int] = []
    for d in docs:
        ids.append(bos)
        ids.extend(tok.encode(d).ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    vocab = tok.get_vocab_size()
    print(f"tokenizer: vocab {vocab}, corpus {len(data)} tokens "
          f"({sum(map(len, docs)) / len(data):.2f} chars/token), {time.time() - t0:.1f}s", flush=True)

    heads, kv_heads = 8, 2
    assert args.hidden % heads == 0 and args.intermediate % 4 == 0
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=args.hidden // heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=hf_tok.pad_token_id,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = len(data) - args.seq_len - 1
    model.train()
    t_train = time.time()
    ema = None
    step = 0
    for step in range(args.steps):
        starts = torch.randint(0, n_windows, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        x, y = batch[:, :-1], batch[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  lr {lr_at(step):.2e}  "
                  f"{el:.0f}s", flush=True)
        if args.max_minutes and time.time() - t_train > args.max_minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    train_s = time.time() - t_train

    # Held-out-free evaluation: mean loss over fixed evenly spaced windows of the corpus.
    model.eval()
    with torch.no_grad():
        starts = torch.linspace(0, n_windows - 1, 64).long().tolist()
        batch = torch.stack([data[s:s + args.seq_len + 1] for s in starts])
        logits = model(input_ids=batch[:, :-1]).logits
        eval_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), batch[:, 1:].reshape(-1)).item()
    print(f"trained {step + 1} steps in {train_s:.0f}s; final ema loss {ema:.4f}; "
          f"eval loss (fp32) {eval_loss:.4f}", flush=True)

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=hf_tok.pad_token_id,
        do_sample=False, max_new_tokens=64,
    )
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    # Portability: name the generic fast-tokenizer class (loadable by transformers 4.x and 5.x)
    # and also embed the chat template in tokenizer_config.json for readers that look there.
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
        f.write("\n")
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)
    with open(os.path.join(out, "training_info.json"), "w") as f:
        json.dump({
            "corpus": "pydoc_data.topics (CPython reference docs, PSF license)",
            "python_version": sys.version.split()[0],
            "corpus_chars": sum(map(len, docs)),
            "corpus_tokens": len(data),
            "steps": step + 1, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "warmup": args.warmup, "seed": args.seed, "threads": args.threads,
            "train_seconds": round(train_s, 1),
            "final_ema_loss": round(ema, 4), "eval_loss": round(eval_loss, 4),
            "torch": torch.__version__,
        }, f, indent=2)
        f.write("\n")
    print(f"saved to {out}", flush=True)

    # Sample continuations from the saved bf16 weights (loaded back as fp32).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    t = AutoTokenizer.from_pretrained(out)
    m.eval()
    for prompt in SAMPLE_PROMPTS:
        enc = t(prompt, return_tensors="pt")
        with torch.no_grad():
            o = m.generate(**enc, max_new_tokens=30, do_sample=False)
        print(f"--- {prompt!r}\n{t.decode(o[0], skip_special_tokens=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
