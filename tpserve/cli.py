"""`tpserve` command line: launch a server, list kernels."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("tpserve")


def _launch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="serve a model tensor-parallel over Ray",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve a model sharded over --tp devices. Without --model, "
                       "serves the small embedded default model (offline, CPU friendly).")
    p.add_argument("--config", type=Path, help="YAML preset (see configs/); flags override it")
    p.add_argument("--model", help="local directory or Hugging Face hub id already in the local "
                   "hub cache (never downloaded); default: the embedded model")
    p.add_argument("--revision", help="hub revision to look up in the cache")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes (benchmarks; needs "
                   "only config.json and a tokenizer)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (shards)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"],
                   help="auto: CUDA, else XPU, else CPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, the checkpoint's dtype on accelerators")
    p.add_argument("--kernel", default="auto",
                   help="attention backend: auto, torch, triton, ipex or an installed plugin")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free port)")
    p.add_argument("--address", help="Ray cluster to join (e.g. auto or HOST:6379); default: "
                   "start a local one")
    p.add_argument("--cpus-per-shard", type=int, default=None,
                   help="CPU device: cores per shard (default: cores / tp, at least 1)")
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
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="tokens per step (long prompts are prefilled in chunks of this)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks per shard (default: sized from memory)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="CPU device: KV-cache memory per shard")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="accelerators: fraction of device memory for weights + KV cache")
    p.add_argument("--prefix-caching", action="store_true",
                   help="reuse the KV blocks of prompt prefixes shared across requests "
                   "(decoder-only models without a sliding window)")
    p.add_argument("--seed", type=int, default=0, help="base seed for unseeded sampling")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run decode eagerly instead of replaying graphs captured in warmup")
    p.add_argument("--no-dashboard", action="store_true",
                   help="do not start the Ray dashboard with the local cluster")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    return p


def _replicas_arg(value: str) -> str:
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError(f"--replicas takes a count >= 1 or auto, not {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _launch_parser(sub)
    k = sub.add_parser("kernels", help="list attention backends and what each supports here")
    k.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"])
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return parser


def apply_preset(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv; values from a --config YAML preset replace the defaults, flags win."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        import yaml

        preset = yaml.safe_load(args.config.read_text()) or {}
        sub = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001
        known = {a.dest for a in sub._actions}  # noqa: SLF001
        unknown = sorted(set(k.replace("-", "_") for k in preset) - known)
        if unknown:
            parser.error(f"{args.config}: unknown keys {', '.join(unknown)}")
        sub.set_defaults(**{k.replace("-", "_"): v for k, v in preset.items()})
        args = parser.parse_args(argv)
    return args


def engine_config(args: argparse.Namespace):
    """Resolve model, device, dtype and limits; log each choice and why."""
    from tpserve.cluster.device import resolve_device, resolve_dtype
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.weights import load_hf_config, resolve_model

    path = resolve_model(args.model, args.revision)
    log.info("model: %s (%s)", path, "embedded default" if args.model is None else args.model)
    hf = load_hf_config(path)
    device, why = resolve_device(args.device)
    log.info("device: %s (%s)", device, why)
    dtype, why = resolve_dtype(args.dtype, device, getattr(hf, "dtype", None)
                               or getattr(hf, "torch_dtype", None))
    log.info("dtype: %s (%s)", dtype, why)
    # T5's positions are relative (no hard limit); its n_positions, else 512, is the default.
    max_pos = (getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
               or (512 if getattr(hf, "is_encoder_decoder", False) else 2048))
    max_len = args.max_total_tokens or min(int(max_pos), 8192)
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
                          load_format=args.load_format),
        parallel=ParallelConfig(tp_size=args.tp, device=device, cpus_per_shard=cpus,
                                ray_address=args.address),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_gb=args.kv_cache_memory_gb,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          prefix_caching=args.prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_batch_size,
                                  max_num_batched_tokens=args.max_batch_tokens,
                                  max_concurrent_requests=args.max_concurrent_requests,
                                  max_input_tokens=args.max_input_tokens),
        kernel=args.kernel, seed=args.seed, cuda_graphs=not args.no_cuda_graphs)
    from tpserve.worker.build import check_shardable

    check_shardable(cfg, hf)
    return cfg


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


def _start_ray(args: argparse.Namespace, cfg, replicas: int = 1) -> None:
    import ray

    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    if args.address:
        ray.init(address=args.address, namespace="tpserve")
        log.info("ray: joined the cluster at %s (%s)", args.address, ray.cluster_resources())
        return
    kwargs = {"include_dashboard": not args.no_dashboard, "namespace": "tpserve"}
    if device == "cpu":
        # Logical CPUs: enough for every shard to be placed even on a small machine.
        kwargs["num_cpus"] = max(os.cpu_count() or 1,
                                 replicas * (tp * cfg.parallel.cpus_per_shard + 1))
    ctx = ray.init(**kwargs)
    log.info("ray: started a local cluster (%s)%s", ray.cluster_resources(),
             f"; dashboard at http://{ctx.dashboard_url}" if ctx.dashboard_url else "")


def launch(args: argparse.Namespace) -> int:
    import ray

    from tpserve.cluster.driver import Driver

    _check_replica_flags(args)
    cfg = engine_config(args)
    if uses_serve(args):
        return launch_replicas(args, cfg)
    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    _start_ray(args, cfg)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    driver = ray.remote(Driver).options(
        name="driver", num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(cfg, args.host, args.port, args.log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = ray.get(driver.start.remote())
        log.info("listening on %s (GET /health turns 200 when every shard is ready)", url)
        summary = ray.get(driver.wait_ready.remote())
        log.info("ready: %d shard(s), backend %s, %d KV blocks per shard, loaded in %.1fs, "
                 "serving %s", tp, summary["backend"], summary["kv_cache_blocks"],
                 summary["load_seconds"], url)
        print(f"tpserve: serving {cfg.model.model_id} on {url} (tp={tp}, {device})", flush=True)
        while not stop.wait(1.0):
            pass
        log.info("shutting down")
        return 0
    except ray.exceptions.RayTaskError as exc:
        log.error("start-up failed: %s", exc.cause if hasattr(exc, "cause") else exc)
        return 1
    finally:
        try:
            ray.get(driver.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        ray.shutdown()


def launch_replicas(args: argparse.Namespace, cfg) -> int:
    """`--replicas R|auto` / `--min-replicas` / `--max-replicas`: R replicas on Ray Serve
    behind one HTTP address (tpserve/serve/)."""
    import ray

    from tpserve.serve import app as serve_app

    tp, device = cfg.parallel.tp_size, cfg.parallel.device
    count = None if args.replicas == "auto" else int(args.replicas)
    _start_ray(args, cfg, count or 1)
    if count is None:
        count = serve_app.replicas_that_fit(cfg)
        if args.max_replicas is not None:
            count = min(count, args.max_replicas)
        log.info("--replicas auto: %d replica(s) of %d shard(s) fit the cluster", count, tp)
    spec = serve_app.ReplicaSpec(num_replicas=count, min_replicas=args.min_replicas,
                                 max_replicas=args.max_replicas)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = serve_app.run(cfg, spec, args.host, args.port)
        scale = (f"autoscaling {spec.min_replicas or 1}..{spec.max_replicas or count}"
                 if spec.autoscaling else f"replicas={count}")
        log.info("ready: %s of tp=%d on Ray Serve, serving %s", scale, tp, url)
        print(f"tpserve: serving {cfg.model.model_id} on {url} (tp={tp}, {scale}, {device})",
              flush=True)
        while not stop.wait(1.0):
            pass
        log.info("shutting down")
        return 0
    except Exception as exc:  # noqa: BLE001 - Serve reports deploy failures as plain errors
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        try:
            serve_app.shutdown()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        ray.shutdown()


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
                "dense": {"paged": False}}
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
    return 0


def _layout(backend, spec) -> str:
    """The backend's cache shape with dimension names, from distinct probe sizes."""
    import dataclasses

    probe = dataclasses.replace(spec, num_kv_heads=2, block_size=5)
    names = {3: "num_blocks", 5: "block_size", 2: "kv_heads", probe.head_dim: "head_dim"}
    shape = backend.kv_cache_shape(3, probe)
    return "[" + ", ".join(names.get(d, str(d)) for d in shape) + "]"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = apply_preset(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tpserve.errors import CheckpointError, KernelUnavailableError, ShardingError

    try:
        if args.command == "launch":
            return launch(args)
        return kernels(args)
    except (CheckpointError, ShardingError, KernelUnavailableError, RuntimeError,
            ValueError) as exc:
        log.error("%s", exc)
        print(f"tpserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
