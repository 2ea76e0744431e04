"""`tpserve` command line: launch a server, list kernels."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

from tpserve import __version__, preflight
from tpserve.config import SpeculativeConfig
from tpserve.errors import CheckpointError
from tpserve.startup import describe, phases
from tpserve.stop_signals import StopSignals, hear_interrupts, leaves_handlers_as_found
from tpserve.tokenizer import check_vocab, load_tokenizer, resolve_tokenizer
from tpserve.tokenizer_files import TOKENIZER_FILES, has_tokenizer

log = logging.getLogger("tpserve")



class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line: argparse printed the whole usage first (some fifty lines
    for launch), which buried the line that says what was wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the "
                     "flags)\n")


class _OneDefaultFormatter(argparse.HelpFormatter):
    """Append "(default: X)" once, and only where the help text does not already say what the
    default is (flags whose default is computed say so in their own words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _launch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="serve a model tensor-parallel over Ray",
                       formatter_class=_OneDefaultFormatter,
                       description="Serve a model sharded over --tp devices. Without --model, "
                       "serves the small embedded default model (offline, CPU friendly).")
    p.add_argument("--config", type=Path, help="YAML preset (see configs/); flags override it")
    p.add_argument("--model", help="local directory or Hugging Face hub id (org/name), taken "
                   "from the hub cache or downloaded into it (config and tokenizer files and the "
                   "safetensors weights the index names, nothing else; HF_TOKEN, HF_ENDPOINT, "
                   "HF_HUB_CACHE and HF_HUB_OFFLINE apply); "
                   "default: the embedded model")
    p.add_argument("--revision", help="hub revision (branch, tag, commit or its first 7 "
                   "digits, refs/pr/N) of a hub id; ignored, with a warning, for a directory")
    p.add_argument("--tokenizer", metavar="PATH_OR_HUB_ID",
                   help="load the tokenizer (and its chat template) from this local directory "
                   "or hub id instead of the model's (a hub id's tokenizer files only, no "
                   "weights); a model without tokenizer files needs it; refused when it has "
                   "more tokens than the model's vocabulary; default: the model's own")
    p.add_argument("--tokenizer-revision",
                   help="hub revision (branch, tag or commit) of a --tokenizer hub id")
    p.add_argument("--download-timeout", type=float, default=None, metavar="SECONDS",
                   help="downloading a hub id: seconds the hub (or a proxy) may stay silent, "
                   "not connecting, not answering a request or sending no byte of a file, "
                   "before the download fails with an error naming it (each wait; a slow "
                   "download that keeps receiving bytes is never cut); default: "
                   "HF_HUB_DOWNLOAD_TIMEOUT where set, else 60")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes (benchmarks; needs "
                   "only config.json and a tokenizer)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (shards)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"],
                   help="auto: CUDA, else XPU, else CPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, the checkpoint's dtype on accelerators")
    p.add_argument("--quantize", default="auto",
                   choices=["auto", "gptq", "awq", "fp8", "compressed-tensors", "none"],
                   help="weight quantization: auto follows the checkpoint's quantization_config "
                   "(GPTQ/AWQ int4, fp8, compressed-tensors fp8 or int4); fp8 also casts a "
                   "float checkpoint to e4m3 at load")
    p.add_argument("--quant-kernel", default="auto",
                   help="int4/fp8 matmul kernel: auto, torch, triton or an installed "
                   "tpserve.quant_kernels plugin")
    p.add_argument("--kernel", default="auto",
                   help="attention backend: auto, torch, triton, ipex or an installed plugin")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free port)")
    p.add_argument("--address", help="Ray cluster to join (e.g. auto or HOST:6379); default: "
                   "start a local one")
    p.add_argument("--placement", default="pack",
                   choices=["pack", "spread", "strict-pack", "strict-spread"],
                   help="where the shards go on a Ray cluster (placement-group strategy): pack "
                   "onto few nodes, spread one per node (best effort), strict-pack on one node, "
                   "strict-spread each on its own node")
    p.add_argument("--max-rebuilds", type=int, default=3,
                   help="when a shard's actor, process or node is lost, tear the shard group "
                   "down and start it again, at most this many times over the server's life "
                   "(0: never; /health then stays 503 with the reason)")
    p.add_argument("--rebuild-backoff", type=float, default=1.0,
                   help="seconds before the first rebuild attempt after a lost shard; each "
                   "failed attempt of the same outage doubles it")
    p.add_argument("--collective-timeout", type=float, default=600.0,
                   help="seconds a collective between shards (or a step) may take before "
                   "the peer counts as hung and its shard group as lost (then rebuilt)")
    p.add_argument("--cpus-per-shard", type=int, default=None,
                   help="CPU device: cores (and torch threads) per shard (default: cores / (tp x "
                   "replicas), at least 1)")
    p.add_argument("--replicas", default="1", type=_replicas_arg,
                   help="model replicas of --tp shards each behind one address, on Ray Serve "
                   "(routed to the least busy, prefix-cache aware); auto: as many as the "
                   "cluster's devices hold; 1: the direct server, without Serve")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale on requests in flight, never below this many replicas")
    p.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale on requests in flight, never above this many replicas")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="prompt + generated tokens per request (default: the model's "
                   "max_position_embeddings, capped at 8192)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="longest prompt accepted (default: max-total-tokens - 1)")
    p.add_argument("--max-concurrent-requests", type=int, default=128,
                   help="requests in flight before answering 429")
    p.add_argument("--max-best-of", type=int, default=2,
                   help="most candidates of one /generate request or /v1/completions "
                   "prompt (`best_of`: those of the highest mean token log-probability are "
                   "answered); 1 refuses best_of > 1 (best_of > n on /v1/completions)")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="most Responses API responses kept in this process's memory for "
                   "previous_response_id and GET /v1/responses/{id} (least recently used "
                   "dropped; lost on restart); 0 turns the store off")
    p.add_argument("--responses-store-mb", type=int, default=256,
                   help="most MiB the stored responses may hold (an estimate: their JSON "
                   "size); least recently used dropped past it")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="most seconds a stored response is kept, read or not (then it answers "
                   "as an unknown id); 0: no age limit. The default, 3600 (an hour), outlasts the "
                   "turns of a conversation and an agent's tool loop, while a conversation "
                   "does not stay in memory for days on a quiet server that the count and "
                   "size bounds would never make drop it")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="tokens per step (long prompts are prefilled in chunks of this)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks per shard (default: sized from memory)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="CPU device: KV-cache memory per shard")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV-cache storage: auto keeps the model dtype; fp8 stores float8 e4m3 "
                   "(scale 1.0), half the bytes of a 16-bit cache, so about twice the blocks "
                   "and half the bytes a decode step reads, at some accuracy cost (torch and "
                   "triton backends; docs/kernels.md)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="accelerators: fraction of device memory for weights + KV cache")
    p.add_argument("--prefix-caching", action="store_true",
                   help="reuse the KV blocks of prompt prefixes shared across requests "
                   "(decoder-only models without a sliding window)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                   help="LoRA adapters served next to the model: PEFT adapter directories "
                   "(adapter_config.json + adapter_model.safetensors), selected per request by "
                   "OpenAI's `model` or TGI's `parameters.adapter_id` (docs/lora.md)")
    p.add_argument("--max-lora-rank", type=int, default=64,
                   help="largest adapter rank served; a larger one is refused at start")
    p.add_argument("--max-loras", type=int, default=4,
                   help="most distinct LoRA adapters in one step; requests of further "
                   "adapters wait until a running adapter's requests finish")
    p.add_argument("--seed", type=int, default=0, help="base seed for unseeded sampling")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "hermes", "llama3_json", "mistral", "pythonic"],
                   help="how chat answers with tool_choice auto are read for tool calls: "
                   "hermes (<tool_call>{...}</tool_call>: Hermes, Qwen), llama3_json (a JSON "
                   "answer {\"name\", \"parameters\"}: Llama 3.1+), mistral "
                   "([TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...}), pythonic "
                   "([f(a=1), g()]: Llama 3.2+), or auto, any of them; text that is no call "
                   "stays content (docs/http_api.md#tool-calling)")
    p.add_argument("--reasoning-parser", default="none",
                   choices=["none", "think", "mistral", "harmony", "auto"],
                   help="thinking models: move the reasoning block of chat and Responses "
                   "answers into message.reasoning_content / reasoning (delta pieces when "
                   "streaming; a reasoning item in the Responses API) and read tool calls "
                   "after it. think reads <think>...</think> (Qwen3, QwQ, DeepSeek-R1), "
                   "mistral [THINK]...[/THINK] (Magistral; special tokens, kept in the text "
                   "for this), harmony gpt-oss's analysis channel before its final one "
                   "(<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>"
                   "final<|message|>), auto the format whose two tags are tokens of the model's "
                   "vocabulary, else none (an info line says which). A prompt that ends with "
                   "the opening tag (DeepSeek-R1, Qwen3-Thinking templates) means the answer "
                   "starts inside it. none leaves the text as it is; /generate and "
                   "/v1/completions are never split (docs/http_api.md#reasoning-models)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run every step eagerly instead of replaying the graphs captured "
                   "in warmup (decode steps whole, other steps of up to 512 tokens in pieces "
                   "around eager attention)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="run steps one at a time instead of preparing the next step on the host "
                        "while the device runs the current one (same outputs; for debugging "
                        "and comparison)")
    p.add_argument("--speculative", default=None, choices=["ngram"],
                   help="speculative decoding: ngram drafts the next tokens of greedy "
                   "requests by finding their last tokens earlier in the prompt and output, "
                   "and verifies them in one forward pass (same outputs; faster when the "
                   "answer quotes its context). Default: off (docs/speculative.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="with --speculative: most tokens drafted per sequence and step (1-16)")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="with --speculative ngram: the longest suffix looked up")
    p.add_argument("--ngram-min", type=int, default=1,
                   help="with --speculative ngram: the shortest suffix looked up")
    p.add_argument("--speculative-max-batch", type=int, default=4,
                   help="with --speculative: no sequence drafts while more than this many "
                   "run (busy batches decode faster plainly; docs/speculative.md)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM: seconds to let in-flight requests finish (new ones "
                   "get 503) before stopping")
    p.add_argument("--no-dashboard", action="store_true",
                   help="do not start the Ray dashboard with the local cluster")
    sec = p.add_argument_group("security and limits (docs/reliability.md)")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require `Authorization: Bearer KEY` on every route but /health "
                     "(repeat for several keys; also TPSERVE_API_KEY, comma-separated, which "
                     "keeps keys out of the process list)")
    sec.add_argument("--metrics-public", action="store_true",
                     help="serve /metrics without an API key (for a Prometheus scraper)")
    sec.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                     help="larger request bodies are answered 413 before being read")
    sec.add_argument("--max-body-bytes-in-flight", type=int, default=None, metavar="BYTES",
                     help="bytes of request bodies held at once, over all requests (each from "
                     "its first byte until it ends); a body that would pass it is answered "
                     "429 before being read; default: 4 x --max-body-bytes")
    sec.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="abort a request (504, or an error event when streaming) that has "
                     "not finished this long after it was handed to the engine; default: none")
    sec.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate")
    sec.add_argument("--ssl-keyfile", help="private key of --ssl-certfile")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log verbosity of tpserve, its driver and its shards")
    return p


def version_string() -> str:
    """tpserve's version and the versions a bug report needs (read without importing them)."""
    parts = []
    for dist in ("torch", "ray", "transformers"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    python = ".".join(str(v) for v in sys.version_info[:3])
    return f"tpserve {__version__} ({', '.join(parts)}, Python {python})"


def _replicas_arg(value: str) -> str:
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError(f"--replicas takes a count >= 1 or auto, not {value!r}")


def build_parser() -> argparse.ArgumentParser:
    # Raw: the version line is not wrapped at the terminal's width.
    parser = _Parser(prog="tpserve", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_string(),
                        help="print the versions of tpserve, torch, ray and transformers")
    # metavar: a bare `tpserve` names the commands it takes, not the word "command".
    sub = parser.add_subparsers(dest="command", required=True, metavar="{launch,kernels}",
                                parser_class=_Parser)
    _launch_parser(sub)
    k = sub.add_parser("kernels", help="list attention backends and what each supports here",
                       formatter_class=_OneDefaultFormatter,
                       description="List the attention backends and the int4/fp8 matmul "
                       "kernels, what each supports on this machine's device and dtype, and "
                       "which one --kernel auto and --quant-kernel auto pick.")
    k.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"],
                   help="device to probe (auto: CUDA, else XPU, else CPU)")
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype to probe")
    return parser


def apply_preset(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv; values from a --config YAML preset replace the defaults, flags win."""
    args, extra = parser.parse_known_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001
    if extra:  # said by the command's parser, whose --help lists its flags
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "config", None):
        import yaml

        try:
            preset = yaml.safe_load(args.config.read_text()) or {}
        except OSError as exc:
            sub.error(f"--config {args.config}: {exc.strerror or exc}")
        except yaml.YAMLError as exc:
            sub.error(f"--config {args.config} is not valid YAML: "
                      f"{' '.join(str(exc).split())}")
        if not isinstance(preset, dict):
            sub.error(f"--config {args.config} must map flag names to values "
                      "(e.g. `tp: 2`), not hold a YAML list or a single value")
        actions = {a.dest: a for a in sub._actions if a.option_strings}  # noqa: SLF001
        unknown = sorted(set(k.replace("-", "_") for k in preset) - set(actions))
        if unknown:
            sub.error(f"{args.config}: unknown keys {', '.join(unknown)}"
                      f"{_did_you_mean(unknown, actions)}: a key is a flag of `tpserve "
                      f"{args.command} --help` without its dashes (tp, max-batch-size)")
        values = {}
        for key, value in preset.items():
            try:
                values[key.replace("-", "_")] = _preset_value(actions[key.replace("-", "_")],
                                                              value)
            except ValueError as exc:
                sub.error(f"{args.config}: {key}: {exc}")
        sub.set_defaults(**values)
        args = parser.parse_args(argv)
    return args


def _did_you_mean(unknown: list[str], actions: dict) -> str:
    import difflib

    near = [m for k in unknown for m in difflib.get_close_matches(k, actions, n=1)]
    return f" (did you mean {', '.join(n.replace('_', '-') for n in near)}?)" if near else ""


def _preset_value(action: argparse.Action, value):
    """A preset's value as the flag would parse it: argparse applies a flag's type and
    choices only to what the command line gives, so a preset's `dtype: float64` or
    `replicas: 1` (an int where the flag yields "1") went through unchecked."""
    if value is None or isinstance(value, list | dict):
        return value  # lists: --lora-modules, --api-key; check_ranges names other misuse
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):  # noqa: SLF001
        return [str(value)]  # `api-key: K`, `lora-modules: a=/x`: one item, not its letters
    if action.nargs == 0:  # store_true flags: `prefix-caching: "no"` would read as true
        if not isinstance(value, bool):
            raise ValueError(f"takes true or false, not {value!r}")
        return value
    if action.type is not None:
        if isinstance(value, bool):
            raise ValueError(f"takes a value, not {value!r}")
        try:
            value = action.type(str(value))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        except (TypeError, ValueError):
            kind = getattr(action.type, "__name__", "value")
            raise ValueError(f"takes {'an' if kind == 'int' else 'a'} {kind}, not {value!r}") \
                from None
    elif action.nargs is None:  # a string flag: `revision: 1234567` is a YAML int
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"takes one of {', '.join(map(str, action.choices))}, not {value!r}")
    return value


def check_checkpoint(path: Path, load_format: str = "safetensors",
                     hub_id: str | None = None, tokenizer_given: bool = False) -> None:
    """Refuse a checkpoint tpserve cannot serve before Ray or the HTTP server start: a
    config.json, safetensors weights (unless --load-format dummy) and tokenizer files
    (unless --tokenizer names them elsewhere: tokenizer_given). hub_id: `path` is that hub
    repository's snapshot in the hub cache."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: pass the directory of a Hugging Face "
                              "checkpoint (config.json, *.safetensors, tokenizer files)")
    if load_format == "safetensors":
        _check_weights(path)
    if tokenizer_given or has_tokenizer(path):
        return
    if hub_id is not None:
        raise CheckpointError(
            f"{hub_id} has no tokenizer on the hub (none of {', '.join(TOKENIZER_FILES)}; "
            f"config.json and the weights are in {path}): pass the tokenizer of the model it "
            "derives from with --tokenizer ID_OR_DIR, or serve a directory: `hf download "
            f"{hub_id} --local-dir DIR`, save that tokenizer into DIR "
            "(`AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR)`), then pass --model DIR")
    raise CheckpointError(
        f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): pass the tokenizer "
        "of the original model with --tokenizer ID_OR_DIR, or copy its files into the "
        "directory, e.g. `AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained(DIR)`")


def _check_weights(path: Path) -> None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc!r})") from None
        missing = sorted(f for f in files if not (path / f).is_file())
        if missing:
            raise CheckpointError(
                f"{index.name} in {path} lists weight files that are not there: "
                f"{', '.join(missing)}; download the checkpoint again (`hf download ID`)")
        return _check_complete([path / f for f in sorted(files)])
    if any(path.glob("*.safetensors")):
        from tpserve.weights import weight_files

        return _check_complete(weight_files(path))  # the files the loader will read
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    found = f" (found {', '.join(pickled)}: pickle files, which tpserve does not load)" \
        if pickled else ""
    raise CheckpointError(
        f"no *.safetensors weights in {path}{found}. Convert the checkpoint once, e.g. "
        "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)` (transformers writes "
        "safetensors) and copy the tokenizer files into OUT, or fetch the safetensors "
        "revision with `hf download ID`.")


def _check_complete(files: list[Path]) -> None:
    """Each weight file holds every byte its header describes: a file cut off (a copy or a
    transfer that stopped) is refused by name before Ray starts, instead of failing in every
    shard with safetensors' "incomplete metadata, file not fully covered"."""
    for f in files:
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n <= size - 8 else None
            end = max((int(v["data_offsets"][1]) for k, v in header.items()
                       if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise CheckpointError(f"{f} is cut off or not a safetensors file (its header "
                                  "does not read): download or copy it again") from None
        if size < 8 + n + end:
            raise CheckpointError(
                f"{f} is cut off: {size} bytes where its header describes {8 + n + end}; "
                "download or copy it again (`hf download ID` resumes into the hub cache)")


def _load_config(path: Path):
    """The checkpoint's transformers config; a config that needs remote code is refused
    (tpserve implements each family itself and never runs code shipped with a checkpoint)."""
    from tpserve.weights import load_hf_config

    try:
        return load_hf_config(path)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc) and "does not recognize" not in str(exc):
            raise
        raise CheckpointError(
            f"{path}: the config needs code that is not part of transformers (auto_map or an "
            "unknown model_type); tpserve does not run code shipped with checkpoints and has "
            "no --trust-remote-code. It serves the families listed in docs/models.md."
            + _legacy_falcon_hint(path)) from None


def _legacy_falcon_hint(path: Path) -> str:
    """For a Falcon config of the remote-code releases (model_type RefinedWebModel or
    RefinedWeb, RWForCausalLM): the rewrite that makes it transformers' Falcon."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return ""
    if model_type not in ("RefinedWebModel", "RefinedWeb"):
        return ""
    return (f" model_type {model_type!r} is Falcon as first released with its own code; the "
            "hub's Falcon repositories now hold transformers' Falcon config (model_type "
            "falcon, FalconForCausalLM): download that revision, or rewrite config.json as "
            "transformers' Falcon conversion did (model_type falcon, architectures "
            "FalconForCausalLM, n_head -> num_attention_heads, n_layer -> num_hidden_layers, "
            "n_head_kv -> num_kv_heads with new_decoder_architecture true, else "
            "new_decoder_architecture false; auto_map removed)")


def engine_config(args: argparse.Namespace):
    """Resolve model, device, dtype and limits; log each choice and why."""
    preflight.check_transformers()
    preflight.check_ranges(args)
    if args.model and Path(args.model).expanduser().is_file():
        raise CheckpointError(
            f"--model {args.model} is a file: pass the checkpoint's directory (config.json, "
            f"*.safetensors, tokenizer files), here {Path(args.model).expanduser().parent}")
    if args.model and Path(args.model).expanduser().is_dir():
        # A local checkpoint is checked before torch is even imported (seconds on a small
        # machine), so a checkpoint tpserve cannot serve is refused at once.
        check_checkpoint(Path(args.model).expanduser().resolve(), args.load_format,
                         tokenizer_given=bool(args.tokenizer))
    from tpserve.cluster.device import resolve_device, resolve_dtype
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.lora_config import launch_config
    from tpserve.weights import resolve_model

    path = resolve_model(args.model, args.revision, weights=args.load_format != "dummy",
                         download_timeout=args.download_timeout)
    log.info("model: %s (%s)", path, "embedded default" if args.model is None else args.model)
    # hub-cache snapshots and the embedded model too
    hub_id = args.model if args.model and path != Path(args.model).expanduser().resolve() \
        else None
    check_checkpoint(path, args.load_format, hub_id, tokenizer_given=bool(args.tokenizer))
    hf = _load_config(path)
    tokenizer = _tokenizer(args, hf)
    device, why = resolve_device(args.device)
    log.info("device: %s (%s)", device, why)
    _check_kernel_names(args)
    dtype, why = resolve_dtype(args.dtype, device, getattr(hf, "dtype", None)
                               or getattr(hf, "torch_dtype", None))
    log.info("dtype: %s (%s)", dtype, why)
    # T5's positions are relative (no hard limit); its n_positions, else 512, is the default.
    max_pos = (getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
               or (512 if getattr(hf, "is_encoder_decoder", False) else 2048))
    max_len = args.max_total_tokens or min(int(max_pos), 8192)
    preflight.check_token_limits(max_len, args.max_input_tokens)
    log.info("max total tokens per request: %d (%s)", max_len,
             "--max-total-tokens" if args.max_total_tokens else
             f"the model's {max_pos} positions" + (", capped at 8192; raise it with "
                                                  "--max-total-tokens" if max_pos > 8192 else ""))
    replicas = getattr(args, "replicas", "1")
    shards = args.tp * (int(replicas) if str(replicas).isdigit() else 1)
    cpus = args.cpus_per_shard or max(1, (os.cpu_count() or 1) // shards)
    if device == "cpu":
        log.info("cpu: %d core(s) per shard x %d shard(s)", cpus, shards)
    cfg = EngineConfig(
        model=ModelConfig(path=str(path), model_id=args.model or "tpserve/default-model",
                          dtype=dtype, max_model_len=max_len, revision=args.revision,
                          load_format=args.load_format, quantize=args.quantize,
                          quant_kernel=args.quant_kernel, tokenizer=tokenizer,
                          tokenizer_id=args.tokenizer,
                          download_timeout_s=args.download_timeout),
        parallel=ParallelConfig(tp_size=args.tp, device=device, cpus_per_shard=cpus,
                                ray_address=args.address, placement=args.placement,
                                dist_timeout_s=args.collective_timeout,
                                max_rebuilds=args.max_rebuilds,
                                rebuild_backoff_s=args.rebuild_backoff),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_gb=args.kv_cache_memory_gb,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          prefix_caching=args.prefix_caching,
                          kv_cache_dtype=_kv_cache_dtype(args)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_batch_size,
                                  max_num_batched_tokens=args.max_batch_tokens,
                                  max_concurrent_requests=args.max_concurrent_requests,
                                  max_input_tokens=args.max_input_tokens,
                                  async_scheduling=not args.no_async_scheduling),
        kernel=args.kernel, seed=args.seed, cuda_graphs=not args.no_cuda_graphs,
        lora=launch_config(getattr(args, "lora_modules", None), args.max_lora_rank,
                           args.max_loras, args.model or "tpserve/default-model"),
        speculative=_speculative(args, hf))
    from tpserve.layers.quant.config import resolve_quant

    quant = resolve_quant(args.quantize, hf, args.quant_kernel)
    log.info("quantization: %s", quant.describe() if quant else "none (float weights)")
    from tpserve.worker.build import check_shardable

    check_shardable(cfg, hf)
    crowded = preflight.check_shard_count(device, shards, args.cpus_per_shard, args.address,
                                          _device_count(device))
    if crowded:
        log.warning(crowded)
    preflight.check_placement(args.placement, args.tp, args.address)
    from dataclasses import replace

    from tpserve.hf_config import quiet_snapshot

    return replace(cfg, model=replace(cfg.model, hf_snapshot=quiet_snapshot(hf)))


def _check_kernel_names(args: argparse.Namespace) -> None:
    """An unknown --kernel or --quant-kernel failed in every shard, with their tracebacks,
    after Ray started. Whether a known one runs on the device is the shards' to say. A joined
    cluster (--address) may hold plugins this machine lacks: its shards decide."""
    if args.address:
        return
    from tpserve.kernels import registry
    from tpserve.kernels.quant import registry as quant_registry

    for flag, name, known in (("--kernel", args.kernel, registry.available_names()),
                              ("--quant-kernel", args.quant_kernel,
                               quant_registry.available_names())):
        if name != "auto" and name not in known:
            raise ValueError(f"{flag} {name!r} is not a kernel here: choose auto or one of "
                             f"{', '.join(known)} (`tpserve kernels` says which run on this "
                             "device; a plugin is one installed under its entry point)")


def _tokenizer(args: argparse.Namespace, hf) -> str:
    """--tokenizer's directory (downloaded where a hub id), its size checked against the
    model's vocabulary; "" without --tokenizer (the model's own)."""
    if not args.tokenizer:
        if args.tokenizer_revision:
            log.warning("--tokenizer-revision %s is ignored: it selects a revision of a hub id "
                        "given with --tokenizer", args.tokenizer_revision)
        return ""
    path = resolve_tokenizer(args.tokenizer, args.tokenizer_revision, args.download_timeout)
    log.info("tokenizer: %s (%s)", path, args.tokenizer)
    try:
        loaded = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - transformers' errors vary by tokenizer class
        raise CheckpointError(f"--tokenizer {args.tokenizer}: cannot load a tokenizer from "
                              f"{path}: {exc}") from None
    check_vocab(loaded, hf, args.tokenizer, args.model or "tpserve/default-model")
    return str(path)


def _speculative(args: argparse.Namespace, hf) -> SpeculativeConfig:
    """--speculative and its knobs (ranges: preflight.check_ranges), refused at start where
    they cannot apply."""
    method = getattr(args, "speculative", None)
    if method not in (None, "ngram"):  # a preset bypasses argparse's choices
        raise ValueError(f"--speculative takes ngram, not {method!r}")
    spec = SpeculativeConfig(method=method,
                             num_tokens=getattr(args, "num_speculative_tokens", 4),
                             ngram_max=getattr(args, "ngram_max", 3),
                             ngram_min=getattr(args, "ngram_min", 1),
                             max_batch=getattr(args, "speculative_max_batch", 4))
    if method and getattr(hf, "is_encoder_decoder", False):
        raise ValueError(f"--speculative {method} serves decoder-only models; this checkpoint "
                         f"is an encoder-decoder model ({hf.model_type}): leave it off")
    if method:
        log.info("speculative decoding: ngram, up to %d drafted tokens per greedy sequence "
                 "and step (suffixes of %d down to %d tokens looked up) while at most %d "
                 "sequences run", spec.num_tokens, spec.ngram_max, spec.ngram_min,
                 spec.max_batch)
    return spec


def _device_count(device: str) -> int | None:
    if device == "cpu":
        return None
    import torch

    return getattr(torch, device).device_count()


def _kv_cache_dtype(args: argparse.Namespace) -> str:
    """--kv-cache-dtype, checked against this torch build before anything starts (each
    shard checks its own device again when it loads)."""
    value = getattr(args, "kv_cache_dtype", "auto")
    if value not in ("auto", "fp8"):  # a preset bypasses argparse's choices
        raise ValueError(f"--kv-cache-dtype takes auto or fp8, not {value!r}")
    if value == "fp8":
        from tpserve.kernels.kv_quant import FP8_DTYPE, fp8_missing

        if FP8_DTYPE is None:
            raise ValueError(fp8_missing())
        log.info("KV cache dtype: float8_e4m3fn (--kv-cache-dtype fp8, scale 1.0)")
    return value


def _dashboard_token_note(dashboard_url: str = "127.0.0.1:8265") -> str:
    """Where the Ray dashboard's token is, when Ray's token authentication is on (ray.init
    sets RAY_AUTH_MODE=token in this process when it turns it on by default)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ""
    where = ("$RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else
             os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")
    return (f" (Ray token auth is on: the dashboard asks for the token in {where}, which "
            "`ray get-auth-token` prints; Ray's CLI sends it only with RAY_AUTH_MODE=token in "
            f"its environment, e.g. `RAY_AUTH_MODE=token ray list actors --address "
            f"http://{dashboard_url}`; RAY_AUTH_MODE=disabled turns it off; see "
            "docs/troubleshooting.md)")


def server_config(args: argparse.Namespace):
    """The HTTP front end's settings; warns when a non-loopback address is open to anyone."""
    import ipaddress

    from tpserve.config import ServerConfig

    keys = list(args.api_key or [])
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key cannot be empty")
    env_keys = os.environ.get("TPSERVE_API_KEY")
    if env_keys is not None:
        keys += [k.strip() for k in env_keys.split(",") if k.strip()]
        if not env_keys.replace(",", "").strip():
            # Set from an unset shell variable, say: serving without a key is not what was meant.
            raise ValueError("TPSERVE_API_KEY is set but holds no key: give it the key (or keys, "
                             "comma-separated), or unset it to serve without one")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1 (got {args.max_body_bytes})")
    in_flight = args.max_body_bytes_in_flight
    if in_flight is not None and in_flight < args.max_body_bytes:
        raise ValueError(f"--max-body-bytes-in-flight ({in_flight}) must be at least "
                         f"--max-body-bytes ({args.max_body_bytes}), or a body of allowed size "
                         "would always be answered 429")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds (got {args.request_timeout})")
    if not args.collective_timeout > 0:
        raise ValueError(f"--collective-timeout must be > 0 seconds (got "
                         f"{args.collective_timeout})")
    if args.max_rebuilds < 0 or not args.rebuild_backoff >= 0:
        raise ValueError("--max-rebuilds and --rebuild-backoff must be 0 or more (got "
                         f"{args.max_rebuilds} and {args.rebuild_backoff})")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both or neither")
    if args.max_best_of < 1:
        raise ValueError(f"--max-best-of must be >= 1 (got {args.max_best_of}); 1 turns "
                         "best_of off")
    if args.responses_store_size < 0 or args.responses_store_mb < 1:
        raise ValueError("--responses-store-size must be >= 0 (0 turns the store off) and "
                         "--responses-store-mb >= 1")
    if not args.responses_store_ttl >= 0:
        raise ValueError(f"--responses-store-ttl must be >= 0 seconds (0: no age limit; got "
                         f"{args.responses_store_ttl})")
    preflight.check_tls_files(args.ssl_certfile, args.ssl_keyfile)
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not keys and not loopback:
        log.warning("serving on %s without an API key: anyone who can reach this address can "
                    "use the model; set TPSERVE_API_KEY or --api-key", args.host)
    return ServerConfig(api_keys=tuple(keys), metrics_public=args.metrics_public,
                        max_body_bytes=args.max_body_bytes,
                        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
                        request_timeout_s=args.request_timeout,
                        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        max_best_of=args.max_best_of,
                        responses_store_size=args.responses_store_size,
                        responses_store_mb=args.responses_store_mb,
                        responses_store_ttl_s=args.responses_store_ttl)


def uses_serve(args: argparse.Namespace) -> bool:
    """Several replicas (or autoscaling) run on Ray Serve; one replica keeps the direct
    server, which adds nothing between the client and the engine (docs/replicas.md)."""
    return (args.replicas != "1" or args.min_replicas is not None
            or args.max_replicas is not None)


def _check_replica_flags(args: argparse.Namespace) -> None:
    lo, hi = args.min_replicas, args.max_replicas
    if lo is not None and lo < 1 or hi is not None and hi < 1:
        raise ValueError("--min-replicas and --max-replicas must be >= 1")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"--min-replicas {lo} is above --max-replicas {hi}")


# Ray binds its GCS, raylet, object manager, agents and workers' gRPC servers to loopback
# only when the node's address is 127.0.0.1, and ray.init turns a 127.0.0.1 it is given back
# into the machine's outward address. This switch (off by default on macOS and Windows) makes
# Ray take 127.0.0.1 as this node's address; Ray reads it once, when it is imported, and
# every process of the cluster inherits it.
_RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray_on_loopback(args: argparse.Namespace) -> None:
    """A local cluster is this machine alone: keep its ports off the network. Call before
    Ray is imported. Not for --address, whose cluster spans machines."""
    if not args.address:
        os.environ[_RAY_CLUSTER_SWITCH] = "0"


def _start_ray(args: argparse.Namespace, cfg, replicas: int = 1) -> None:
    import ipaddress

    import ray

    from tpserve.cluster.device import local_cluster_gpus

    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    if args.address:
        preflight.check_ray_address(args.address)
        try:
            ray.init(address=args.address, namespace="tpserve")
        except ConnectionError as exc:
            raise RuntimeError(
                f"could not join the Ray cluster at --address {args.address} ({exc}): start "
                "one with `ray start --head`, or leave out --address to start a local "
                "cluster") from None
        log.info("ray: joined the cluster at %s (%s)", args.address, ray.cluster_resources())
        return
    # "local": a new cluster even when another one runs on this machine (a second tpserve, a
    # test's): without it Ray joins the newest live local cluster, which refuses num_cpus.
    kwargs = {"address": "local", "include_dashboard": not args.no_dashboard,
              "namespace": "tpserve"}
    if device == "cpu":
        # Logical CPUs: enough for every shard to be placed even on a small machine.
        kwargs["num_cpus"] = max(os.cpu_count() or 1,
                                 replicas * (tp * cfg.parallel.cpus_per_shard + 1))
    gpus = local_cluster_gpus(device)
    if gpus is not None:
        kwargs["num_gpus"] = gpus  # XPU tiles, which Ray counts only through dpctl
    ctx = ray.init(**kwargs)
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        log.warning("ray: the local cluster's ports listen on every interface (node address "
                    "%s): Ray was imported before tpserve could set %s=0", node,
                    _RAY_CLUSTER_SWITCH)
    log.info("ray: started a local cluster (%s)%s", ray.cluster_resources(),
             f"; dashboard at http://{ctx.dashboard_url}"
             f"{_dashboard_token_note(ctx.dashboard_url)}"
             if ctx.dashboard_url else "")


@leaves_handlers_as_found
def launch(args: argparse.Namespace) -> int:
    t0, wall0 = time.perf_counter(), time.time()
    cfg = engine_config(args)  # every checkpoint and config check, before Ray starts
    server = server_config(args)
    checked = time.time()

    _check_replica_flags(args)
    preflight.check_port(args.host, args.port)  # before Ray: its start takes seconds
    _ray_on_loopback(args)
    import ray

    from tpserve.cluster.driver import Driver

    if uses_serve(args):
        return launch_replicas(args, cfg, server)
    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    _start_ray(args, cfg)
    ray_up = time.time()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tpserve.cluster.placement import driver_names

    here = ray.get_runtime_context().get_node_id()
    names = driver_names()
    for name in names:  # another deployment on this cluster may hold "driver"
        try:
            driver = ray.remote(Driver).options(
                name=name, num_cpus=0, max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            ).remote(cfg, args.host, args.port, args.log_level, server)
            break
        except ValueError as exc:
            if "already taken" not in str(exc) or name == names[-1]:
                raise
    # A second Ctrl-C skips the drain. Lock-free flags: tpserve/stop_signals.py says why.
    signals = StopSignals()
    stop, force = signals.stop, signals.force
    signals.install()
    try:
        url = ray.get(driver.start.remote())
        log.info("listening on %s (GET /health turns 200 when every shard is ready)", url)
        summary = _wait(driver.wait_ready.remote(), stop)
        if summary is None:
            log.info("stopped before the model was ready")
            return 0
        # The weights' load time is logged once, by the engine ("weights loaded in"); this
        # line gives the whole start-up as a user waits for it.
        log.info("ready: %d shard(s), backend %s, %d KV blocks per shard, warmup %.1fs, "
                 "ready %.1fs after launch, serving %s (placement %s)", tp, summary["backend"],
                 summary["kv_cache_blocks"], summary.get("warmup_seconds") or 0.0,
                 time.perf_counter() - t0, url, cfg.parallel.placement)
        log.info("start-up: %s", describe(
            phases(wall0, [("checks", checked), ("ray", ray_up),
                           ("driver", summary.get("placed_at"))])
            + summary.get("startup", [])))
        print(f"tpserve: serving {cfg.model.model_id} on {url} (tp={tp}, {device})", flush=True)
        while not stop.wait(1.0):
            lost = _driver_lost(driver)
            if lost:
                # The HTTP server and the engine loop went with it (and the shards, which
                # it owned): exit, so that a supervisor (systemd, Kubernetes) restarts us.
                log.error("the driver actor (HTTP server and engine loop) died: %s; "
                          "stopping", lost)
                print(f"tpserve: error: the driver actor died ({lost}); restart tpserve "
                      "launch", file=sys.stderr, flush=True)
                return 1
        log.info("shutting down: new requests get 503; in-flight ones have up to %.0fs "
                 "(--shutdown-timeout; a second Ctrl-C skips this)", args.shutdown_timeout)
        left = _wait(driver.drain.remote(args.shutdown_timeout), force)
        if left:
            log.warning("%d request(s) still running after --shutdown-timeout; ending them",
                        left)
        return 0
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if hasattr(exc, "cause") else exc
        print(f"tpserve: error: start-up failed: {cause}", file=sys.stderr)
        return 1
    finally:
        try:
            ray.get(driver.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        ray.kill(driver)
        _stop_ray(args.address)


def _stop_ray(address: str | None) -> None:
    """Leave Ray and say what is left, on stdout as the "serving" line (seen at any
    --log-level). A local cluster this process started is shut down and waited for (its
    workers exit with its raylet); a joined cluster (--address) keeps running, only this
    launch's actors are gone."""
    import ray

    ray.shutdown(wait_for_processes=True)
    left = (f"the Ray cluster at --address {address} keeps running" if address
            else "the local Ray cluster it started has exited")
    print(f"tpserve: stopped ({left})", flush=True)


def _driver_lost(driver) -> str | None:
    """Why the driver actor is gone, or None while it answers (or is only slow)."""
    import ray

    try:
        ray.get(driver.ready.remote(), timeout=10)
    except ray.exceptions.RayActorError as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    except ray.exceptions.GetTimeoutError:
        pass  # busy, not gone: its HTTP server may still answer
    return None


def _wait(ref, cancel: threading.Event):
    """ray.get that gives up (returns None) once `cancel` is set, so signals are heard."""
    import ray

    while not cancel.is_set():
        done, _ = ray.wait([ref], timeout=0.5)
        if done:
            return ray.get(ref)
    return None


@leaves_handlers_as_found
def launch_replicas(args: argparse.Namespace, cfg, server) -> int:
    """`--replicas R|auto` / `--min-replicas` / `--max-replicas`: R replicas on Ray Serve
    behind one HTTP address (tpserve/serve/)."""
    if server.ssl_certfile:
        raise ValueError("--ssl-certfile/--ssl-keyfile are not supported with --replicas "
                         "(Ray Serve's HTTP proxy serves plain HTTP): terminate TLS in a proxy "
                         "in front of it")
    from tpserve.serve import app as serve_app

    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    count = None if args.replicas == "auto" else int(args.replicas)
    _start_ray(args, cfg, count or 1)
    if count is None:
        count = serve_app.replicas_that_fit(cfg)
        if args.max_replicas is not None:
            count = min(count, args.max_replicas)
        log.info("--replicas auto: %d replica(s) of %d shard(s) fit the cluster", count, tp)
    from tpserve.cluster.placement import ray_strategy

    spec = serve_app.ReplicaSpec(num_replicas=count, min_replicas=args.min_replicas,
                                 max_replicas=args.max_replicas,
                                 placement_strategy=ray_strategy(cfg.parallel.placement),
                                 grpc_on_loopback=not args.address)
    try:
        serve_app.check_replicas_fit(cfg, spec.replicas_wanted, spec.shard_cpus)
    except RuntimeError as exc:
        if not args.address:
            _stop_ray(args.address)
            raise
        # A joined cluster may scale up; Serve waits for the replicas (Ctrl-C stops it).
        log.warning("%s Waiting for the cluster to scale up (Ctrl-C stops).", exc)
    # A second Ctrl-C skips the drain. Lock-free flags: tpserve/stop_signals.py says why.
    signals = StopSignals()
    stop, force = signals.stop, signals.force
    signals.install()
    ours = True
    try:
        url = _until_ready(lambda: serve_app.run(cfg, spec, args.host, args.port,
                                                 server=server), stop)
        if url is None:
            log.info("stopped before the replicas were ready")
            return 0
        scale = (f"autoscaling {spec.min_replicas or 1}..{spec.max_replicas or count}"
                 if spec.autoscaling else f"replicas={count}")
        log.info("ready: %s of tp=%d on Ray Serve, serving %s", scale, tp, url)
        print(f"tpserve: serving {cfg.model.model_id} on {url} (tp={tp}, {scale}, {device})",
              flush=True)
        while not stop.wait(1.0):
            pass
        log.info("shutting down: new requests get 503; in-flight ones have up to %.0fs "
                 "(--shutdown-timeout; a second Ctrl-C skips this)", args.shutdown_timeout)
        left = serve_app.drain(args.shutdown_timeout, force)
        if left:
            log.warning("%d request(s) still running after --shutdown-timeout; ending them",
                        left)
        return 0
    except Exception as exc:  # noqa: BLE001 - Serve reports deploy failures as plain errors
        print(f"tpserve: error: start-up failed: {exc}", file=sys.stderr, flush=True)
        # Another launch's application: stopping Serve would stop it too.
        ours = not isinstance(exc, serve_app.AppExistsError)
        return 1
    finally:
        if ours:
            try:
                serve_app.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        _stop_ray(args.address)


def _until_ready(run, stop: threading.Event):
    """run() (serve.run: it returns once every replica has loaded, however long that takes,
    and Ctrl-C did not end it) in a thread; its result, or None once `stop` is set."""
    done, box = threading.Event(), {}

    def target() -> None:
        try:
            box["url"] = run()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="tpserve-serve-run", daemon=True).start()
    while not done.wait(0.5):
        if stop.is_set():
            return None
    if "error" in box:
        raise box["error"]
    return box["url"]


def kernels(args: argparse.Namespace) -> int:
    """Print every backend (built-in and plugin), what it supports on this machine's device
    and dtype, its KV-cache layout, and which one --kernel auto would pick."""
    import dataclasses

    import torch

    from tpserve.cluster.device import resolve_device
    from tpserve.errors import KernelUnavailableError
    from tpserve.kernels import registry
    from tpserve.kernels.base import AttentionSpec

    device, _ = resolve_device(args.device)
    dev, dtype = torch.device(device), getattr(torch, args.dtype)
    base = AttentionSpec(8, 2, 128, 128**-0.5)
    fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    variants = {"prefill+decode": {}, "sliding_window": {"sliding_window": 4096},
                "alibi": {"alibi": True}, "softcap": {"softcap": 50.0},
                "head_dim 96": {"head_dim": 96, "scale": 96**-0.5},
                # Encoder-decoder features, probed only where AttentionSpec has them.
                "non_causal": {"causal": False}, "relative_bias": {"relative_bias": True},
                "dense": {"paged": False}, "fp8_kv_cache": {"kv_cache_dtype": "fp8"},
                "sinks": {"sinks": True}, "chunked": {"attention_chunk": 8192}}
    probes = {k: dataclasses.replace(base, **v) for k, v in variants.items() if set(v) <= fields}
    try:
        chosen = registry.select_backend("auto", dev, dtype, [base])[0].name
    except KernelUnavailableError as exc:
        chosen = f"none ({exc})"
    print(f"attention backends on {device} ({args.dtype}); --kernel auto picks: {chosen}")
    for name in registry.available_names():
        reasons = {f: registry.why_not(name, dev, dtype, spec) for f, spec in probes.items()}
        ok = [f for f, r in reasons.items() if r is None]
        print(f"  {name} ({registry.origin(name)})")
        if not ok:
            print(f"      unavailable: {reasons['prefill+decode']}")
            continue
        print(f"      supports: {', '.join(ok)}")
        for f, r in reasons.items():
            if r:
                print(f"      not {f}: {r}")
        print(f"      KV cache layout: {_layout(registry.load_backend_class(name)(), base)}")
    _quant_kernels(dev, dtype)
    return 0


def _quant_kernels(dev, dtype) -> None:
    """The int4 / fp8 matmul kernels (--quant-kernel) and why each cannot run here."""
    from tpserve.kernels.quant import registry as qreg

    print(f"quantized matmul kernels on {dev} ({dtype}); --quant-kernel auto picks the first "
          "built-in that runs")
    for name in qreg.available_names():
        reasons = {m: qreg.why_not(name, dev, dtype, m) for m in ("int4", "fp8")}
        ok = [m for m, r in reasons.items() if r is None]
        print(f"  {name}: " + (f"supports {', '.join(ok)}" if ok else "unavailable")
              + "".join(f"; not {m}: {r}" for m, r in reasons.items() if r))


def _layout(backend, spec) -> str:
    """The backend's cache shape with dimension names, from distinct probe sizes."""
    import dataclasses

    probe = dataclasses.replace(spec, num_kv_heads=2, block_size=5)
    names = {3: "num_blocks", 5: "block_size", 2: "kv_heads", probe.head_dim: "head_dim"}
    shape = backend.kv_cache_shape(3, probe)
    return "[" + ", ".join(names.get(d, str(d)) for d in shape) + "]"


class _PlainText:
    """A text stream that drops terminal escape sequences (colours, cursor moves) on the way
    to the stream it wraps; everything else is the wrapped stream's."""

    _ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(self._ESCAPES.sub("", text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _plain_text_when_not_a_terminal() -> None:
    """Keep colour codes out of logs written to files and pipes: Ray colours its dashboard
    line, its worker-log prefixes and its repeated-line notes whatever the output is. Runs
    before logging.basicConfig, whose handler keeps the stream it is given."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not stream.isatty() and not isinstance(stream, _PlainText):
            setattr(sys, name, _PlainText(stream))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = apply_preset(parser, sys.argv[1:] if argv is None else argv)
    if argv is None:  # the command line itself, not a caller in the same process
        _plain_text_when_not_a_terminal()
        hear_interrupts()
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tpserve.errors import KernelUnavailableError, ShardingError

    try:
        if args.command == "launch":
            return launch(args)
        return kernels(args)
    except (CheckpointError, ShardingError, KernelUnavailableError, RuntimeError,
            ValueError) as exc:
        # One line, no traceback: the message says what to do.
        print(f"tpserve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server's own handlers are in place
        print("tpserve: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
