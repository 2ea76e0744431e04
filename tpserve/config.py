"""Frozen configuration shared by the driver and the workers (plain values; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    path: str  # resolved local directory holding config.json and *.safetensors
    model_id: str  # what the user asked for (hub id or path), for /info
    dtype: str = "float32"  # resolved torch dtype name
    max_model_len: int = 2048
    revision: str | None = None
    # "safetensors": read the checkpoint; "dummy": random weights of the right shapes, for
    # benchmarks of a model shape without its checkpoint (config.json + tokenizer only).
    load_format: str = "safetensors"
    # auto: the checkpoint's quantization_config; gptq | awq | fp8 | none (fp8 also casts an
    # unquantized checkpoint at load). quant_kernel: the int4/fp8 matmul kernel, or auto.
    quantize: str = "auto"
    quant_kernel: str = "auto"
    # --tokenizer: the resolved local directory of the tokenizer files, when they come from
    # elsewhere than `path` (a model saved without them, or a fixed tokenizer), and what the
    # user named (directory or hub id, for /info). Empty: the tokenizer of `path`.
    tokenizer: str = ""
    tokenizer_id: str | None = None
    # Seconds the hub may stay silent while a node downloads model_id (tpserve/hub.py);
    # None: HF_HUB_DOWNLOAD_TIMEOUT where set, else 60.
    download_timeout_s: float | None = None
    # The launcher's checked transformers config as plain data (tpserve/hf_config.py), set
    # once check_shardable passed: shards and the driver read it instead of importing
    # transformers' config machinery again (seconds per process). Empty: read config.json.
    hf_snapshot: str = field(default="", repr=False, compare=False)

    @property
    def tokenizer_path(self) -> str:
        """The directory the tokenizer (and its chat template) is loaded from."""
        return self.tokenizer or self.path


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    device: str = "cpu"  # "cpu" | "cuda" | "xpu" (resolved; never "auto" here)
    cpus_per_shard: int = 1
    dist_timeout_s: float = 600.0
    ray_address: str | None = None
    # Ray placement-group strategy of the shards: pack | spread | strict-pack | strict-spread
    # (tpserve/cluster/placement.py).
    placement: str = "pack"
    # A lost shard (actor, process or node) rebuilds the whole group: at most this many
    # attempts over the server's life, backing off rebuild_backoff_s, 2x, 4x... per outage.
    max_rebuilds: int = 3
    rebuild_backoff_s: float = 1.0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly this many blocks when set; else sized from kv_cache_memory_gb (CPU) or
    # gpu_memory_utilization (accelerators) after the weights are loaded.
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    # Reuse the KV blocks of a shared prompt prefix across requests (prefix_cache.py).
    prefix_caching: bool = False
    # "auto": the cache holds the model dtype; "fp8": float8 e4m3 (half the bytes of 16-bit
    # dtypes, about twice the blocks), on backends that support it (kernels/kv_quant.py).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None  # default: max_model_len - 1
    # Overlapped steps: prepare step n+1 on the host while the device runs step n.
    async_scheduling: bool = True


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (tpserve/engine/speculative.py); method None: off."""

    method: str | None = None
    num_tokens: int = 4  # drafted tokens verified per step and sequence, at most
    ngram_max: int = 3  # the longest, then shorter, suffix looked up in the context
    ngram_min: int = 1
    # Running sequences above which none drafts: a verification step runs eagerly around
    # its attention and costs more than a captured decode step, which a busy batch's few
    # accepted drafts do not pay back (docs/speculative.md, "Served on a GPU").
    max_batch: int = 4

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative {self.method!r}: the methods are "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens {self.num_tokens}: must be 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}")
        if self.max_batch < 1:
            raise ValueError(f"--speculative-max-batch {self.max_batch}: must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} / --ngram-max {self.ngram_max}: "
                             "need 1 <= --ngram-min <= --ngram-max")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served next to the base model (docs/lora.md). Adapter i of `adapters`
    is slot i + 1 on every shard; slot 0 is the base model."""

    adapters: tuple[tuple[str, str], ...] = ()  # (name, local directory), in launch order
    max_rank: int = 64  # --max-lora-rank: a larger adapter rank is refused at start
    max_loras: int = 4  # --max-loras: most distinct adapters in one step

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.adapters)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: str = "auto"
    seed: int = 0
    # Capture decode steps as CUDA graphs in warmup (CUDA with a graph-safe backend only).
    cuda_graphs: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


# Default --max-body-bytes-in-flight: this many bodies of --max-body-bytes. 16 MiB at the
# defaults: 128 requests in flight (--max-concurrent-requests) of 128 KiB each, four times
# the JSON of an 8k-token prompt.
BODY_BUDGET_BODIES = 4


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end's security and reliability settings (never sent to the shards)."""

    # Bearer keys accepted on every route but /health (and /metrics when metrics_public).
    # Empty: no authentication (cli.py warns when the bind address is not loopback).
    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False
    # Larger request bodies get 413 before they are read whole.
    max_body_bytes: int = 4 * 1024 * 1024
    # Bytes of request bodies held at once over all requests (from the first byte until the
    # request ends); a body that would pass it gets 429. None: BODY_BUDGET_BODIES bodies of
    # max_body_bytes.
    max_body_bytes_in_flight: int | None = None
    # Per-request deadline from arrival to the last token, queueing included (None: none).
    request_timeout_s: float | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # How `tool_choice: "auto"` answers are read for calls: auto (every known format),
    # hermes, llama3_json or mistral (tpserve/server/tool_parsers.py).
    tool_call_parser: str = "auto"
    # How chat and Responses answers are split into reasoning and content: none (not split),
    # think (<think>...</think>), mistral ([THINK]...[/THINK]) or auto (the format whose
    # tags are tokens of the vocabulary; tpserve/server/reasoning.py, reasoning_format.py).
    reasoning_parser: str = "none"
    # `best_of`: most candidates generated for one /generate answer or /v1/completions
    # prompt (1: refused, unless equal to `n` there).
    # Validation of the HTTP front end, as in TGI's router, so it lives here, not in the engine.
    max_best_of: int = 2
    # The Responses API's store (server/responses_store.py), in this process's memory: most
    # responses kept for previous_response_id and GET /v1/responses/{id} (0: off), and the
    # most MiB they may hold; past either, the least recently used go. Each is kept at most
    # responses_store_ttl_s seconds (0: no age limit; cli.py's --responses-store-ttl says
    # why an hour).
    responses_store_size: int = 1000
    responses_store_mb: int = 256
    responses_store_ttl_s: float = 3600.0

    @property
    def body_budget_bytes(self) -> int:
        if self.max_body_bytes_in_flight is not None:
            return self.max_body_bytes_in_flight
        return BODY_BUDGET_BODIES * self.max_body_bytes
