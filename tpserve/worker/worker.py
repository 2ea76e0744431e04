"""One shard of the model on one device. Runs inside a Ray actor (tpserve/executor/
ray_executor.py) or directly in a test process (in-process executor); every method is a typed
call and every constructor returns."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tpserve.cluster.device import dist_backend, local_device, memory_info
from tpserve.config import EngineConfig
from tpserve.distributed import TPInfo, reset_tp, set_tp
from tpserve.engine.step import StepBatch, StepOutput
from tpserve.hf_config import ConfigData
from tpserve.kernels import gemv, kv_quant
from tpserve.kernels.base import AttentionSpec
from tpserve.kernels.compile_cache import compile_count
from tpserve.kernels.gemm_tuning import GemmTuning
from tpserve.kernels.registry import select_backend
from tpserve.layers.attention import AttentionLayer
from tpserve.startup import now, process_started_at
from tpserve.weights import LoadStats, iter_checkpoint, load_hf_config, node_model_path
from tpserve.worker import piecewise
from tpserve.worker.build import build_model, fill_dummy
from tpserve.worker.control import STOP, ControlChannel, decode_step, encode_step
from tpserve.worker.graphs import DecodeGraphs, graph_buckets, graphs_supported
from tpserve.worker.lora_loader import attach_adapters
from tpserve.worker.model_runner import ModelRunner, PendingStep

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    rank: int
    seconds: float
    param_bytes: int
    read_bytes: dict[str, int] = field(default_factory=dict)
    full_bytes: dict[str, int] = field(default_factory=dict)
    backend: str = ""
    passed_over: dict[str, str] = field(default_factory=dict)
    cache_bytes_per_block: int = 0
    cache_dtype: str = ""  # the KV cache's storage dtype, e.g. "bfloat16" or "float8_e4m3fn"
    # Each cache-owning attention layer's window (None: the whole sequence), as the model
    # built it: what the scheduler may free blocks by.
    windows: tuple[int | None, ...] = ()


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        return addr == "localhost"


def _gloo_on_loopback() -> None:
    """Every rank is on this machine: gloo's pairs (the process group's on the CPU, the
    control channel's on every device) listen on loopback. Without it gloo listens on the
    address the host name resolves to, which may be one other machines reach."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # read by each new gloo group


class Worker:
    """Set-up of one shard: process group, weights, KV-cache sizing and allocation, warmup
    and graph capture; steps go to its ModelRunner."""

    def __init__(self, cfg: EngineConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.tp_size = cfg.parallel.tp_size
        if cfg.parallel.device == "cpu":
            torch.set_num_threads(max(1, cfg.parallel.cpus_per_shard))
        self.dtype = getattr(torch, cfg.model.dtype)
        self.kv_dtype: torch.dtype | None = None  # the cache's storage dtype, in load_weights
        self.device: torch.device | None = None
        self.model = None
        self.backend = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.specs: list[AttentionSpec] = []  # of the layers owning a cache, by layer_index
        self.encoder_decoder = False
        self.steps = 0
        self.graphs = None  # DecodeGraphs once captured (CUDA, a graph-safe backend)
        self.pieces = None  # PiecewiseGraphs once captured (the other steps, CUDA)
        self.gemv_choices: dict = {}  # weight shape -> GemvChoice, from warmup (CUDA, XPU)
        self.num_blocks = 0
        self.compiles_at_warmup: int | None = None
        self.runner: ModelRunner | None = None  # once the cache is allocated
        self.control: ControlChannel | None = None  # tp > 1: rank 0 -> other ranks, per step
        # Wall-clock ends of the start-up phases (tpserve/startup.py): the process
        # came up, this object exists (imports done), then each set-up call below.
        self.marks: dict[str, float | None] = {"process": process_started_at(), "init": now()}
        # The checkpoint's config, read now: the first read imports transformers' config
        # machinery (seconds; 7-9 s on the H200 host, where it pulls in torchvision), which
        # this way overlaps the driver's own config and tokenizer loading instead of
        # following it. A node without the directory reads it in load_weights.
        self.hf_config = None
        try:
            if cfg.model.hf_snapshot:  # the launcher's, as data: no transformers import here
                self.hf_config = ConfigData(cfg.model.hf_snapshot)
            elif Path(cfg.model.path).is_dir():
                self.hf_config = load_hf_config(Path(cfg.model.path))
        except Exception:  # noqa: BLE001 - load_weights reads it again and reports the error
            self.hf_config = None
        self.marks["config"] = now()

    def __repr__(self) -> str:
        # Shown by Ray's state API and the dashboard's actors view (rank and device).
        return (f"Worker(rank {self.rank}/{self.tp_size}, "
                f"{self.device or self.cfg.parallel.device}, {self.cfg.model.model_id})")

    # --- set-up -------------------------------------------------------------------------
    def node_ip(self) -> str:
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray, the loopback address will do
            return "127.0.0.1"

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def _store(self, addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
        """The process group's rendezvous. Rank 0 serves it on `addr` alone: torch's own
        server listens on every interface, and on a one-machine cluster addr is loopback."""
        if self.rank != 0:
            return dist.TCPStore(addr, port, self.tp_size, False, timeout)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.create_server((addr, port), family=family)
        try:
            store = dist.TCPStore(addr, port, self.tp_size, True, timeout,
                                  master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the socket now, and closes it
        return store

    def init_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the shards' process group; returns the backend name."""
        self.device = local_device(self.cfg.parallel.device)
        backend = dist_backend(self.cfg.parallel.device)
        if self.tp_size > 1:
            timeout = timedelta(seconds=self.cfg.parallel.dist_timeout_s)
            if _is_loopback(master_addr):
                _gloo_on_loopback()
            dist.init_process_group(
                backend=backend, store=self._store(master_addr, master_port, timeout),
                rank=self.rank, world_size=self.tp_size, timeout=timeout)
            set_tp(TPInfo(self.rank, self.tp_size), dist.group.WORLD)
            self.control = ControlChannel(self.tp_size, self.cfg.parallel.dist_timeout_s)
        else:
            set_tp(TPInfo(0, 1))
        self.marks["device"] = now()
        return backend if self.tp_size > 1 else "none (tp=1)"

    def load_weights(self) -> LoadReport:
        t0 = time.perf_counter()
        m = self.cfg.model
        # rayops hook: a node without the launching node's directory resolves the hub id.
        path = str(node_model_path(m.path, m.model_id, m.revision, m.load_format != "dummy",
                                   m.download_timeout_s))
        # A snapshot describes the checkpoint wherever this node keeps it.
        same = self.hf_config is not None and (bool(m.hf_snapshot) or Path(path) == Path(m.path))
        hf = self.hf_config if same else load_hf_config(path)
        self.model = build_model(self.cfg, hf, self.device)
        stats = LoadStats()
        desc = f"shard {self.rank}/{self.tp_size} loading weights"
        if self.cfg.model.load_format == "dummy":
            fill_dummy(self.model, seed=self.cfg.seed + self.rank)
        else:
            self.model.load_weights(iter_checkpoint(Path(path), stats, self.rank == 0, desc))
        if self.cfg.lora.adapters:
            attach_adapters(self.model, self.cfg.lora, self.dtype, self.device)
        self.model.eval()
        layers = self._attention_layers()
        owners = sorted((m for m in layers if m.owns_cache), key=lambda m: m.layer_index)
        if [m.layer_index for m in owners] != list(range(len(owners))):
            raise RuntimeError(f"{type(self.model).__name__}: cache-owning attention layers "
                               "must have layer_index 0..n-1 (a tpserve bug)")
        self._set_cache_dtype(layers)
        self.specs = [m.spec for m in owners]
        self.encoder_decoder = bool(getattr(self.model, "is_encoder_decoder", False))
        # Every layer's spec counts, cache or not (cross and dense attention too).
        unique = list(dict.fromkeys(m.spec for m in layers))
        self.backend, passed = select_backend(self.cfg.kernel, self.device, self.dtype, unique)
        params = sum(p.numel() * p.element_size()
                     for p in dict.fromkeys(self.model.parameters()))
        self.marks["weights"] = now()
        return LoadReport(self.rank, time.perf_counter() - t0, params, stats.read_bytes,
                          stats.full_bytes, self.backend.name, passed, self._bytes_per_block(),
                          str(self.kv_dtype).replace("torch.", ""),
                          tuple(spec.sliding_window for spec in self.specs))

    def _attention_layers(self) -> list[AttentionLayer]:
        return [m for m in self.model.modules() if isinstance(m, AttentionLayer)]

    def _set_cache_dtype(self, layers: list[AttentionLayer]) -> None:
        """The cache's dtype (--kv-cache-dtype) on every layer that reads or writes the paged
        cache (self and cross attention; an encoder's dense attention has none), before the
        backend is chosen, so only backends that can read it are."""
        kind = self.cfg.cache.kv_cache_dtype
        if kind == "fp8":
            why = kv_quant.fp8_unavailable(self.device)
            if why:
                raise RuntimeError(f"--kv-cache-dtype fp8 cannot run on {self.device}: {why}")
        self.kv_dtype = kv_quant.cache_dtype(kind, self.dtype)
        for m in layers:
            if m.spec.paged:
                m.spec = replace(m.spec, kv_cache_dtype=kind)

    def _bytes_per_block(self) -> int:
        elt = torch.tensor([], dtype=self.kv_dtype).element_size()
        return sum(2 * elt * math.prod(self.backend.kv_cache_shape(1, self._with_block(spec)))
                   for spec in self.specs)

    def _with_block(self, spec: AttentionSpec) -> AttentionSpec:
        return replace(spec, block_size=self.cfg.cache.block_size)

    def available_blocks(self) -> int:
        """How many KV blocks fit on this shard (the driver takes the minimum over ranks)."""
        cache = self.cfg.cache
        if cache.num_blocks:
            return cache.num_blocks
        per_block = self._bytes_per_block()
        if self.device.type == "cpu":
            budget = cache.kv_cache_memory_gb * 2**30
        else:
            free, total = memory_info(self.device)
            budget = free - (1 - cache.gpu_memory_utilization) * total
        # More blocks than every sequence at full length could use is wasted memory.
        useful = self.cfg.scheduler.max_num_seqs * -(-self.cfg.model.max_model_len
                                                     // self.cfg.cache.block_size)
        return max(0, min(useful, int(budget // per_block)))

    def allocate_cache(self, num_blocks: int) -> None:
        """num_blocks for the engine, plus one scratch block (id num_blocks) that no sequence
        owns: padded rows of a captured decode graph write there."""
        self.kv_caches = []
        self.num_blocks = num_blocks
        for spec in self.specs:
            shape = self.backend.kv_cache_shape(num_blocks + 1, self._with_block(spec))
            self.kv_caches.append((torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                                   torch.zeros(shape, dtype=self.kv_dtype, device=self.device)))
        self.specs = [self._with_block(s) for s in self.specs]
        self.marks["cache"] = now()
        for m in self._attention_layers():
            if m.spec.paged:
                m.spec = self._with_block(m.spec)
        self.runner = ModelRunner(self.model, self.kv_caches, self.backend, self.device,
                                  self.rank, self.cfg.cache.block_size, self.cfg.seed,
                                  share_sampled=self.cfg.scheduler.async_scheduling)

    @torch.inference_mode()  # as in execute(): compiled code guards on the grad mode
    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> float:
        """Let the backend compile its kernels for the shapes it will see; seconds taken."""
        t0 = time.perf_counter()
        if self.runner is not None:  # the backend may be swapped before warmup (tests)
            self.runner.backend = self.backend
        sizes = tuple(batch_sizes)
        if self.cfg.cuda_graphs and graphs_supported(self.device, self.backend,
                                                     self.encoder_decoder) is None:
            # Graphs are captured at finer buckets: the kernels must have seen them too.
            sizes = tuple(sorted(set(sizes) | set(graph_buckets(max(sizes)))))
        for spec in dict.fromkeys(m.spec for m in self._attention_layers()):
            self.backend.warmup(self.device, self.dtype, spec, sizes)
        # Quantized weights in their kernel's own layout (int4: the tensor-core GEMV's
        # fragment order where TPSERVE_INT4_LAYOUT=fragment), before anything captures them.
        packed = sum(m.method.pack(m, self.dtype) for m in self.model.modules()
                     if callable(getattr(getattr(m, "method", None), "pack", None)))
        if packed:
            log.info("%d quantized layers repacked for their kernel", packed)
        # Before the graphs: each captures whichever path (GEMV or F.linear) was chosen.
        self.gemv_choices = gemv.assign(self.model.modules())
        self._fold_norms()
        self.marks["kernels"] = now()
        self._capture_graphs(batch_sizes)
        self.marks["graphs"] = now()
        # Baseline for health()'s compiles_since_warmup: serving must never compile.
        self.compiles_at_warmup = compile_count(self.backend)
        return time.perf_counter() - t0

    def _fold_norms(self) -> None:
        """Where the one-row QKV and down projections of a Llama-shaped model run the GEMV,
        fold the input norms into QKV (LlamaModel.fold_norms): a single stream's step loses
        32 of its 65 norm launches. Set TPSERVE_FOLD_NORMS=0 to keep them (A/B runs)."""
        fold = getattr(self.model, "fold_norms", None)
        # A LoRA delta reads the normalised input of qkv_proj, which a fold never forms.
        if fold is None or os.environ.get("TPSERVE_FOLD_NORMS") == "0" or self.cfg.lora.adapters:
            return
        why = fold()
        if why is None:
            log.info("input norms folded into the QKV projections: one-row steps launch "
                     "one norm a layer instead of two")
        elif self.gemv_choices:  # only worth a line where the GEMV could have run
            log.info("norms not folded: %s", why)

    def _capture_graphs(self, batch_sizes: tuple[int, ...]) -> None:
        if not self.cfg.cuda_graphs:
            return
        why = graphs_supported(self.device, self.backend, self.encoder_decoder)
        if why:
            if self.device.type != "cpu":
                log.info("decode runs eagerly: %s", why)
            return
        bs = self.cfg.cache.block_size
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.device,
                                   graph_buckets(max(batch_sizes)), -(-self.cfg.model.max_model_len // bs), bs,
                                   scratch_block=self.num_blocks)
        tuning = GemmTuning(self.device, self.rank)
        tuning.start()
        seconds = self.graphs.capture(tuning)
        tuning.finish()
        self.runner.graphs = self.graphs
        log.info("captured decode graphs for batch sizes %s in %.2fs%s",
                 ",".join(map(str, self.graphs.buckets)), seconds,
                 " (twice: with LoRA adapters, and without for steps that use none)"
                 if self.graphs.base_graphs else "")
        self._capture_pieces()

    def _capture_pieces(self) -> None:
        """The other steps (mixed prefill + decode, mostly) up to 512 tokens as graphs in
        pieces around eager attention (worker/piecewise.py). TPSERVE_PIECEWISE_GRAPHS=0
        keeps them eager (A/B runs). A model that cannot be captured so serves eagerly."""
        if not piecewise.wanted():
            return
        buckets = piecewise.token_buckets(self.cfg.scheduler.max_num_batched_tokens, self.model)
        pieces = piecewise.PiecewiseGraphs(self.model, self.kv_caches, self.backend,
                                           self.device, buckets, self.cfg.cache.block_size,
                                           scratch_block=self.num_blocks)
        try:
            seconds = pieces.capture(self.dtype)
        except Exception as exc:  # noqa: BLE001 - eager steps still serve
            log.warning("mixed steps run eagerly: capturing them in pieces failed (%s: %s)",
                        type(exc).__name__, exc)
            return
        self.pieces = pieces
        self.runner.pieces = pieces
        log.info("captured mixed steps in graph pieces for %s tokens in %.2fs",
                 ",".join(map(str, pieces.buckets)), seconds)

    def health(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "steps": self.steps,
                "pid": os.getpid(), "backend": getattr(self.backend, "name", None),
                "compiles_since_warmup": (compile_count(self.backend) - self.compiles_at_warmup
                                          if self.compiles_at_warmup is not None else None),
                "decode_graphs": list(self.graphs.buckets) if self.graphs else [],
                "piecewise_graphs": list(self.pieces.buckets) if self.pieces else []}

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' follow() loops (they return their step counts)."""
        if self.rank == 0 and self.control is not None:
            self.control.send_stop()

    def shutdown(self) -> None:
        self.control = None
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tp()

    # --- serving ------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step; rank 0 returns the sampled tokens, other ranks None."""
        pending = self.launch(batch)
        return None if pending is None else pending.result()

    def launch(self, batch: StepBatch) -> PendingStep | None:
        """Queue one step on the device (the other ranks get it over the control channel);
        rank 0's pending result, whose result() waits for the sampled tokens."""
        if self.runner is None:
            raise RuntimeError("execute() before allocate_cache(): the engine sizes and "
                               "allocates the KV cache first")
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} runs steps in follow(); only rank 0 takes "
                               "execute() calls")
        self.steps += 1
        if self.control is not None:
            self.control.send(encode_step(batch))
        return self.runner.launch(batch)

    def follow(self) -> int:
        """Ranks 1..tp-1: run every step rank 0 broadcasts until it sends STOP; returns the
        number of steps run. Started once after warmup; a failure here (a dead peer, the
        group's timeout) raises, which the executor sees through this call's result."""
        if self.rank == 0 or self.control is None or self.runner is None:
            raise RuntimeError("follow() runs on ranks > 0 of a tp > 1 group after "
                               "allocate_cache()")
        while True:
            msg = self.control.recv()
            if int(msg[0]) == STOP:
                return self.steps
            self.steps += 1
            # Launched, not waited for: this rank only has to keep the collectives paired.
            self.runner.launch(decode_step(msg))
