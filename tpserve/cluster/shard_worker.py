"""One shard of the model on one device. Runs inside a Ray actor (see worker_group.py) or
directly in a test process; every method is a typed call and every constructor returns."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tpserve.cluster.device import dist_backend, local_device, memory_info
from tpserve.cluster.graphs import DecodeGraphs, graphs_supported
from tpserve.config import EngineConfig
from tpserve.distributed import TPInfo, reset_tp, set_tp
from tpserve.engine.step import SeqStep, StepBatch, StepOutput
from tpserve.kernels.base import AttentionMetadata, AttentionSpec
from tpserve.kernels.compile_cache import compile_count
from tpserve.kernels.registry import select_backend
from tpserve.layers.attention import AttentionLayer
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.layers.sampler import sample_seq_steps as sample
from tpserve.models.registry import model_class
from tpserve.weights import LoadStats, iter_checkpoint, load_hf_config, node_model_path

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


@contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_model(cfg: EngineConfig, hf_config, device: torch.device):
    """The model class for this checkpoint with this rank's parameter shapes (uninitialised).
    On the meta device this costs nothing, which is how the driver checks sharding early."""
    from tpserve.layers.quant.config import quant_context, resolve_quant

    cls = model_class(hf_config)
    quant = resolve_quant(cfg.model.quantize, hf_config, cfg.model.quant_kernel)
    with torch.device(device), default_dtype(getattr(torch, cfg.model.dtype)), \
            quant_context(quant):
        return cls(hf_config, max_positions=cfg.model.max_model_len)


@torch.no_grad()
def fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (norm weights 1) so activations stay finite at any depth."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dtype in (torch.int32, torch.int64):  # packed int4: any bits are valid nibbles
            p.random_(generator=g)
        elif p.element_size() == 1:  # fp8: no uniform_ of its own
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-0.02, 0.02, generator=g))
        else:
            p.uniform_(-0.02, 0.02, generator=g)


def check_shardable(cfg: EngineConfig, hf_config) -> None:
    """Build every rank's model on the meta device: a tp the checkpoint cannot take fails
    here, before any actor starts, with the tensor and the rule in the message."""
    from tpserve.distributed import tp_context

    for rank in range(cfg.parallel.tp_size):
        with tp_context(rank, cfg.parallel.tp_size):
            build_model(cfg, hf_config, torch.device("meta"))


class ShardWorker:
    def __init__(self, cfg: EngineConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.tp_size = cfg.parallel.tp_size
        if cfg.parallel.device == "cpu":
            torch.set_num_threads(max(1, cfg.parallel.cpus_per_shard))
        self.dtype = getattr(torch, cfg.model.dtype)
        self.device: torch.device | None = None
        self.model = None
        self.backend = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.specs: list[AttentionSpec] = []  # of the layers owning a cache, by layer_index
        self.encoder_decoder = False
        self.steps = 0
        self.graphs = None  # DecodeGraphs once captured (CUDA, a graph-safe backend)
        self.num_blocks = 0
        self.compiles_at_warmup: int | None = None

    def __repr__(self) -> str:
        # rayops hook: the Ray dashboard's actors view shows this (rank and device).
        return (f"ShardWorker(rank {self.rank}/{self.tp_size}, "
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

    def init_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the shards' process group; returns the backend name."""
        self.device = local_device(self.cfg.parallel.device)
        backend = dist_backend(self.cfg.parallel.device)
        if self.tp_size > 1:
            dist.init_process_group(
                backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank, world_size=self.tp_size,
                timeout=timedelta(seconds=self.cfg.parallel.dist_timeout_s))
            set_tp(TPInfo(self.rank, self.tp_size), dist.group.WORLD)
        else:
            set_tp(TPInfo(0, 1))
        return backend if self.tp_size > 1 else "none (tp=1)"

    def load_weights(self) -> LoadReport:
        t0 = time.perf_counter()
        m = self.cfg.model
        # rayops hook: a node without the launching node's directory resolves the hub id.
        path = str(node_model_path(m.path, m.model_id, m.revision, m.load_format != "dummy"))
        hf = load_hf_config(path)
        self.model = build_model(self.cfg, hf, self.device)
        stats = LoadStats()
        desc = f"shard {self.rank}/{self.tp_size} loading weights"
        if self.cfg.model.load_format == "dummy":
            fill_dummy(self.model, seed=self.cfg.seed + self.rank)
        else:
            self.model.load_weights(iter_checkpoint(Path(path), stats, self.rank == 0, desc))
        self.model.eval()
        layers = self._attention_layers()
        owners = sorted((m for m in layers if m.owns_cache), key=lambda m: m.layer_index)
        if [m.layer_index for m in owners] != list(range(len(owners))):
            raise RuntimeError(f"{type(self.model).__name__}: cache-owning attention layers "
                               "must have layer_index 0..n-1 (a tpserve bug)")
        self.specs = [m.spec for m in owners]
        self.encoder_decoder = bool(getattr(self.model, "is_encoder_decoder", False))
        # Every layer's spec counts, cache or not (cross and dense attention too).
        unique = list(dict.fromkeys(m.spec for m in layers))
        self.backend, passed = select_backend(self.cfg.kernel, self.device, self.dtype, unique)
        params = sum(p.numel() * p.element_size()
                     for p in dict.fromkeys(self.model.parameters()))
        return LoadReport(self.rank, time.perf_counter() - t0, params, stats.read_bytes,
                          stats.full_bytes, self.backend.name, passed, self._bytes_per_block())

    def _attention_layers(self) -> list[AttentionLayer]:
        return [m for m in self.model.modules() if isinstance(m, AttentionLayer)]

    def _bytes_per_block(self) -> int:
        elt = torch.tensor([], dtype=self.dtype).element_size()
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
            self.kv_caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                                   torch.zeros(shape, dtype=self.dtype, device=self.device)))
        self.specs = [self._with_block(s) for s in self.specs]
        for m in self._attention_layers():
            if m.spec.paged:
                m.spec = self._with_block(m.spec)

    @torch.inference_mode()  # as in execute(): compiled code guards on the grad mode
    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> float:
        """Let the backend compile its kernels for the shapes it will see; seconds taken."""
        t0 = time.perf_counter()
        for spec in dict.fromkeys(m.spec for m in self._attention_layers()):
            self.backend.warmup(self.device, self.dtype, spec, batch_sizes)
        self._capture_graphs(batch_sizes)
        # Baseline for health()'s compiles_since_warmup: serving must never compile.
        self.compiles_at_warmup = compile_count(self.backend)
        return time.perf_counter() - t0

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
                                   batch_sizes, -(-self.cfg.model.max_model_len // bs), bs,
                                   scratch_block=self.num_blocks)
        seconds = self.graphs.capture()
        log.info("captured decode graphs for batch sizes %s in %.2fs",
                 ",".join(map(str, self.graphs.buckets)), seconds)

    def health(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "steps": self.steps,
                "pid": os.getpid(), "backend": getattr(self.backend, "name", None),
                "compiles_since_warmup": (compile_count(self.backend) - self.compiles_at_warmup
                                          if self.compiles_at_warmup is not None else None),
                "decode_graphs": list(self.graphs.buckets) if self.graphs else []}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tp()

    # --- serving ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step; rank 0 returns the sampled tokens, other ranks None."""
        self.steps += 1
        dev, seqs = self.device, batch.seqs
        if self.graphs is not None and self.graphs.fits(seqs):
            return self._finish(batch, self.graphs.run(seqs).float())
        bs = self.cfg.cache.block_size
        q_lens = [len(s.token_ids) for s in seqs]
        seq_lens = [s.seq_len for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s.start_pos, s.seq_len) for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int32).clamp_(min=0)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(q_lens))
        slots = tables[seq_of_token, positions // bs].long() * bs + positions % bs
        starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(q_lens).cumsum(0)
        meta = AttentionMetadata(
            query_start_loc=starts.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                                  device=dev),
            block_tables=tables.to(dev), slot_mapping=slots.to(dev),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_host=tuple(q_lens), seq_lens_host=tuple(seq_lens))
        cross = self._encode(seqs, meta) if self.encoder_decoder else None
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend, cross)):
            hidden = self.model(ids.to(dev), positions.to(dev))
        ends = starts[1:].tolist()
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        rows = [ends[i] - 1 for i in sampled]
        lp_seqs = [i for i, s in enumerate(seqs) if s.prompt_logprobs and q_lens[i] > 1]
        for i in lp_seqs:
            rows.extend(range(ends[i] - q_lens[i], ends[i] - 1))
        if not rows:
            return StepOutput(batch.step_id, []) if self.rank == 0 else None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
        if self.rank != 0:
            return None
        tokens = sample(logits[: len(sampled)], [seqs[i] for i in sampled], self.cfg.seed)
        out = StepOutput(batch.step_id, tokens)
        row = len(sampled)
        for i in lp_seqs:
            n = q_lens[i] - 1
            nxt = torch.tensor(seqs[i].token_ids[1:], device=logits.device)
            lps = logits[row : row + n].log_softmax(-1).gather(1, nxt[:, None])[:, 0]
            out.prompt_logprobs[seqs[i].seq_id] = lps.tolist()
            row += n
        if batch.return_logits:
            out.logits = logits[: len(sampled)].cpu().numpy()
        return out

    def _finish(self, batch: StepBatch, logits: torch.Tensor) -> StepOutput | None:
        """Sample a decode-only step whose logits (every row samples) came from a graph."""
        if self.rank != 0:
            return None
        out = StepOutput(batch.step_id, sample(logits, batch.seqs, self.cfg.seed))
        if batch.return_logits:
            out.logits = logits.cpu().numpy()
        return out

    def _encode(self, seqs: list[SeqStep], meta: AttentionMetadata) -> AttentionMetadata:
        """Encoder-decoder models: run the encoder for the sequences whose decoder starts
        this step, which stores every decoder layer's cross K/V in their cross blocks; return
        the metadata cross attention reads all sequences' cross K/V with."""
        dev, bs = self.device, self.cfg.cache.block_size
        enc_lens = [s.encoder_len for s in seqs]
        width = max(len(s.cross_block_table) for s in seqs)
        tables = torch.tensor([s.cross_block_table + [0] * (width - len(s.cross_block_table))
                               for s in seqs], dtype=torch.int32)
        new = [i for i, s in enumerate(seqs) if s.encoder_ids is not None]
        if new:
            lens = [len(seqs[i].encoder_ids) for i in new]
            ids = torch.tensor([t for i in new for t in seqs[i].encoder_ids], dtype=torch.long)
            positions = torch.cat([torch.arange(n) for n in lens])
            sub = tables[new]
            seq_of_token = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(lens))
            slots = sub[seq_of_token, positions // bs].long() * bs + positions % bs
            starts = torch.zeros(len(new) + 1, dtype=torch.int32)
            starts[1:] = torch.tensor(lens).cumsum(0)
            enc_meta = AttentionMetadata(
                query_start_loc=starts.to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                block_tables=sub.to(dev), slot_mapping=slots.to(dev), max_query_len=max(lens),
                max_seq_len=max(lens), query_lens_host=tuple(lens), seq_lens_host=tuple(lens))
            with forward_context(ForwardContext(enc_meta, self.kv_caches, self.backend)):
                self.model.encode(ids.to(dev), positions.to(dev))
        return AttentionMetadata(
            query_start_loc=meta.query_start_loc,
            seq_lens=torch.tensor(enc_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev), slot_mapping=meta.slot_mapping[:0],
            max_query_len=meta.max_query_len, max_seq_len=max(enc_lens),
            query_lens_host=meta.query_lens_host, seq_lens_host=tuple(enc_lens))

