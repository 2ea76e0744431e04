"""LoRA adapters in captured steps (layers/lora.py's masked delta) against transformers + peft
in float32 on the CPU: decode graphs through their static buffers (each bucket replayed
eagerly) and mixed steps in pieces (tests/op_graph.py), two adapters and the base model in
one batch; guards that each row's slot matters; a server without adapters captures nothing
of LoRA; the real capture on CUDA (-m gpu)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_rel, cuda_engine, make_engine
from lora_utils import (
    NAMES,
    NEW,
    PROMPTS,
    engine_greedy,
    lora_config,
    mixed,
    mixed_oracle,
    oracle_logits,
    two_adapters,
)
from op_graph import OpGraph, cpu_piece_capture_api

from tpserve.engine.request import SamplingParams
from tpserve.layers.context import ForwardContext, forward_context
from tpserve.layers.lora import LoraRows, LoraWeights, lora_rows
from tpserve.worker import piecewise
from tpserve.worker.graphs import DecodeGraphs

REL = 1e-4
BUCKETS = (1, 2, 8, 16)  # the mixed batch's 9 rows replay 16: 7 padded rows


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    return two_adapters(llama_dir, tmp_path_factory.mktemp("lora-graphs"))


@pytest.fixture(scope="module")
def oracle(llama_dir, adapters):
    return mixed_oracle(llama_dir, adapters)


def want_tokens(oracle) -> list[list[int]]:
    return [oracle[n][1][i] for i in range(len(PROMPTS)) for n in NAMES]


class EagerReplay:
    """Stands in for a CUDA graph: replay() recomputes the bucket from the static buffers
    (as tests/test_cuda_graphs.py's), with or without LoRA as the graph was captured;
    records each replay's row slots."""

    def __init__(self, graphs: DecodeGraphs, bucket: int, out: torch.Tensor,
                 lora: bool = True) -> None:
        self.graphs, self.bucket, self.out, self.lora = graphs, bucket, out, lora
        self.slots: list[list[int]] = []

    def replay(self) -> None:
        self.slots.append(self.graphs.lora.slot[: self.bucket].tolist())
        self.out.copy_(self.graphs._forward(self.bucket, self.lora))


class SwappedReplay(EagerReplay):
    """Replays with rows 0 and 1 (prompt 0 under the base model and under adapter a)
    trading their slots."""

    def replay(self) -> None:
        slot = self.graphs.lora.slot
        assert slot[0].item() != slot[1].item()
        slot[[0, 1]] = slot[[1, 0]]
        super().replay()


def lora_engine(llama_dir, adapters, replay=EagerReplay):
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64, lora=lora_config(adapters))
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                          BUCKETS, max_blocks=64, block_size=4, scratch_block=worker.num_blocks)
    for b in graphs.buckets:
        for lora, into in ((True, graphs.graphs), (False, graphs.base_graphs)):
            out = graphs._forward(b, lora)
            into[b] = (replay(graphs, b, out, lora), out)
    worker.graphs = worker.runner.graphs = graphs
    return engine, graphs


def last_logits(engine, requests, n: int) -> list[torch.Tensor]:
    """Each request's logits at its last sampled position (a decode step), steps collected
    one at a time."""
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                 adapter=a)) for p, a in requests]
    logits = {}
    while engine.has_work():
        _, out = engine.step(return_logits=True)
        for row, t in enumerate(out.tokens if out is not None else []):
            logits[t.seq_id] = torch.tensor(out.logits[row])
    return [logits[s.seq_id] for s in seqs]


@pytest.mark.parametrize("tp", [1, 2])
def test_masked_delta_equals_the_per_adapter_loop(llama_dir, adapters, tp):
    """Every LoRA layer of each rank's shard: the masked delta (captured steps) equals the
    per-adapter loop (eager steps) row for row, and base rows keep y bit for bit."""
    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.distributed import tp_context
    from tpserve.weights import load_hf_config
    from tpserve.worker.build import build_model
    from tpserve.worker.lora_loader import attach_adapters

    slots = torch.tensor([-1, 0, 1, 0, -1, 1, 1])
    base = slots < 0
    gen = torch.Generator().manual_seed(0)
    ecfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="t"),
                        parallel=ParallelConfig(tp_size=tp))
    for rank in range(tp):
        with tp_context(rank, tp):
            model = build_model(ecfg, load_hf_config(llama_dir), torch.device("cpu"))
            attach_adapters(model, lora_config(adapters), torch.float32, torch.device("cpu"))
        layers = [m for m in model.modules() if isinstance(m, LoraWeights)]
        assert len(layers) == 4 * len(model.model.layers)
        for lw in layers:
            x = torch.randn(len(slots), lw.a.shape[-1], generator=gen)
            y = torch.randn(len(slots), lw.b_all.shape[0], generator=gen)
            groups = [(s, torch.nonzero(slots == s)[:, 0]) for s in (0, 1)]
            with lora_rows(LoraRows(groups=groups)):
                loop = lw.add(y, x)
            unused = slots[:, None] != torch.arange(lw.slots)
            with lora_rows(LoraRows(unused=unused)):
                masked = lw.add(y, x)
            torch.testing.assert_close(masked, loop, rtol=1e-5, atol=1e-5)
            assert torch.equal(masked[base], y[base])
            assert not torch.allclose(masked[~base], y[~base])  # guard: a delta was added


def test_static_buffer_decode_path_serves_adapters(llama_dir, adapters, oracle):
    """Decode steps of two adapters and the base model in one batch replay the graphs (bucket
    16, 7 padded rows): the last decode step's logits within 1e-4 of transformers + peft on
    the same tokens, and greedy tokens identical with overlapped steps."""
    engine, graphs = lora_engine(llama_dir, adapters)
    try:
        got = last_logits(engine, mixed(), NEW)
        for (prompt, name), logits, tokens in zip(mixed(), got, want_tokens(oracle),
                                                  strict=True):
            want = oracle_logits(llama_dir, adapters.get(name), [prompt + tokens[:-1]])[0]
            assert_close_rel(logits, want, REL)
        assert engine_greedy(engine, mixed(), NEW) == want_tokens(oracle)
    finally:
        engine.shutdown()
    replays = graphs.graphs[16][0].slots
    assert len(replays) >= 2 * (NEW - 1)
    # Rows of adapter a (0), b (1) and the base model (-1), then the padding (-1).
    assert replays[0] == [-1, 0, 1] * 3 + [-1] * 7
    # Every step held adapter rows: none replayed the graphs without LoRA.
    assert not any(g.slots for g, _ in graphs.base_graphs.values())


def test_steps_of_base_rows_replay_the_graphs_without_lora(llama_dir, adapters, oracle):
    """A server with adapters loaded: decode steps in which no row names an adapter replay
    the graphs captured without LoRA (bucket 8 and 16 here), and give transformers' base
    tokens and logits; a step with one adapter row among base rows replays the LoRA graph
    and gives that row its adapter's tokens."""
    engine, graphs = lora_engine(llama_dir, adapters)
    base = [(p, None) for p in PROMPTS] * 3  # 9 rows: bucket 16
    try:
        got = last_logits(engine, base, NEW)
        for (prompt, _), logits, tokens in zip(base, got, oracle[None][1] * 3, strict=True):
            want = oracle_logits(llama_dir, None, [prompt + tokens[:-1]])[0]
            assert_close_rel(logits, want, REL)
        assert engine_greedy(engine, base, NEW) == oracle[None][1] * 3
        assert len(graphs.base_graphs[16][0].slots) >= 2 * (NEW - 1)
        assert not graphs.graphs[16][0].slots
        one = [(p, None) for p in PROMPTS] + [(PROMPTS[0], "b")]  # 4 rows: bucket 8
        assert engine_greedy(engine, one, NEW) == oracle[None][1] + [oracle["b"][1][0]]
    finally:
        engine.shutdown()
    assert len(graphs.graphs[8][0].slots) >= NEW - 1 and not graphs.base_graphs[8][0].slots


def test_swapping_two_rows_slots_changes_their_tokens(llama_dir, adapters, oracle):
    """Guard: the test above can fail. Replays with prompt 0's base and adapter-a rows
    trading slots give those rows other tokens."""
    engine, _ = lora_engine(llama_dir, adapters, SwappedReplay)
    try:
        got = engine_greedy(engine, mixed(), NEW)
    finally:
        engine.shutdown()
    want = want_tokens(oracle)
    assert got[0] != want[0] and got[1] != want[1]


def staggered(engine, requests, n: int, every: int = 2) -> list[list[int]]:
    """Greedy continuations with the (prompt, adapter) requests admitted one by one, `every`
    steps apart: prompts are prefilled in steps where other adapters' rows decode."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, adapter=a) for _, a in requests]
    pending = list(zip([p for p, _ in requests], params, strict=True))
    seqs, step = [], 0
    while pending or engine.has_work():
        if pending and step % every == 0:
            seqs.append(engine.add_request(*pending.pop(0)))
        engine.step()
        step += 1
    return [s.output_ids for s in seqs]


def pieces_engine(llama_dir, lora, monkeypatch):
    monkeypatch.setattr(piecewise, "piece_capture_api", cpu_piece_capture_api)
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64, lora=lora)
    worker = engine.executor.worker
    pieces = piecewise.PiecewiseGraphs(worker.model, worker.kv_caches, worker.backend,
                                       worker.device, (16, 32), worker.cfg.cache.block_size,
                                       scratch_block=worker.num_blocks)
    pieces.capture(worker.dtype)
    worker.pieces = worker.runner.pieces = pieces
    return engine, pieces


@pytest.mark.parametrize("blind", [False, True], ids=["slots", "guard-no-slots"])
def test_mixed_steps_in_pieces_serve_adapters(llama_dir, adapters, oracle, monkeypatch,
                                              blind):
    """Every step replays the pieces (no decode graphs here): prompts of both adapters and
    the base model prefilled next to each other's decode rows give transformers + peft's
    tokens. Guard: pieces that never see the slots (every row -1) give other tokens."""
    engine, pieces = pieces_engine(llama_dir, lora_config(adapters), monkeypatch)
    seen, run = [], pieces.run

    def spy(ids, positions, meta, lora_slots=None):
        if lora_slots is None:  # no row names an adapter: the pieces without LoRA
            seen.append((len(meta.query_lens_host), None))
            return run(ids, positions, meta)
        seen.append((len(meta.query_lens_host), lora_slots.tolist()))
        return run(ids, positions, meta,
                   torch.full_like(lora_slots, -1) if blind else lora_slots)

    monkeypatch.setattr(pieces, "run", spy)
    try:
        got = staggered(engine, mixed(), NEW)
    finally:
        engine.shutdown()
    if blind:
        assert got != want_tokens(oracle)
        return
    assert got == want_tokens(oracle)
    # Steps that prefilled one adapter's prompt beside other adapters' decode rows.
    assert any(s and len(set(s)) == 3 and len(s) > seqs for seqs, s in seen), seen
    # The first step prefills a base-model prompt alone: the pieces without LoRA.
    assert seen[0][1] is None
    assert all(s is None or any(x >= 0 for x in s) for _, s in seen), seen


def test_mixed_steps_of_base_rows_replay_the_pieces_without_lora(llama_dir, adapters,
                                                                 oracle, monkeypatch):
    """A server with adapters loaded, base-model requests admitted one by one: every step
    replays the pieces captured without LoRA, and the tokens are transformers' base
    model's."""
    engine, pieces = pieces_engine(llama_dir, lora_config(adapters), monkeypatch)
    counts = {"lora": 0, "base": 0}
    for name, captured in (("lora", pieces.captured), ("base", pieces.base_captured)):
        for bucket in captured.values():
            bucket.graphs = [_Counted(g, counts, name) for g in bucket.graphs]
    try:
        got = staggered(engine, [(p, None) for p in PROMPTS], NEW)
    finally:
        engine.shutdown()
    assert got == oracle[None][1]
    assert counts["base"] > 0 and counts["lora"] == 0, counts


LORA_OPS = ("aten.ne.Tensor_out", "aten.masked_fill.Scalar")


def op_names(graphs) -> list[str]:
    return [str(func) for g in graphs for func, *_ in g.ops]


def recorded(fn) -> list[str]:
    g = OpGraph()
    g.capture_begin()
    try:
        fn()
    finally:
        g.capture_end()
    return op_names([g])


def decode_ops(llama_dir, lora):
    """A decode bucket of 4 rows: its DecodeGraphs, the ops its capture records, those of
    the model's forward and LM head alone on the same buffers, and the model's LoRA layers."""
    engine = make_engine(llama_dir, 1, local=True, num_blocks=64, lora=lora)
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device, (4,),
                          max_blocks=64, block_size=4, scratch_block=worker.num_blocks)
    graphs._fill_padding()

    def plain():
        with forward_context(ForwardContext(graphs._meta(4), worker.kv_caches,
                                            worker.backend)):
            hidden = worker.model(graphs.ids[:4], graphs.positions[:4])
        worker.model.compute_logits(hidden)

    try:
        decode, reference = recorded(lambda: graphs._forward(4)), recorded(plain)
        without = recorded(lambda: graphs._forward(4, lora=False))
    finally:
        engine.shutdown()
    assert without == reference  # the graphs without LoRA: the model's own ops only
    return graphs, decode, reference, sum(isinstance(m, LoraWeights)
                                          for m in worker.model.modules())


def test_a_server_without_adapters_captures_nothing_of_lora(llama_dir, adapters,
                                                            monkeypatch):
    """No LoRA buffers and no LoRA ops: a decode bucket records the very ops of the model's
    forward and LM head (what it captured before LoRA could be captured), and the pieces
    hold no slot comparison. Guard: with adapters, each decode bucket and each bucket of
    pieces holds one comparison more, and one masked fill more per LoRA layer."""
    counts = {}
    for lora in (None, lora_config(adapters)):
        graphs, decode, reference, n_lora = decode_ops(llama_dir, lora)
        engine, pieces = pieces_engine(llama_dir, lora, monkeypatch)
        engine.shutdown()
        tensors = {k for k, v in vars(graphs).items() if isinstance(v, torch.Tensor)}
        assert tensors == {"ids", "positions", "slots", "tables", "seq_lens", "starts"}
        if lora is None:
            assert graphs.lora is None and pieces.lora is None and n_lora == 0
            assert decode == reference
        else:
            assert graphs.lora is not None and pieces.lora is not None and n_lora == 8
            assert decode != reference
        for what, ops in [("decode", decode)] + [(t, op_names(b.graphs))
                                                 for t, b in pieces.captured.items()]:
            got = [ops.count(op) for op in LORA_OPS]
            if lora is None:
                assert got[0] == 0
                counts[what] = got
            else:
                assert got == [1, counts[what][1] + n_lora], what
        if lora is None:
            assert not pieces.base_captured
        else:  # the pieces without LoRA: the ops of a server without adapters
            assert set(pieces.base_captured) == set(pieces.captured)
            for t, b in pieces.base_captured.items():
                assert [op_names(b.graphs).count(op) for op in LORA_OPS] == counts[t], t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
def test_captured_graphs_serve_adapters_on_cuda(llama_dir, adapters, oracle, overlap):
    """Captured decode graphs and pieces with two adapters and the base model in one batch,
    the Triton kernels: transformers + peft's tokens, decode steps and prefills next to
    decode rows replayed with adapter rows, nothing compiled after warmup."""
    engine = cuda_engine(llama_dir, overlap, lora=lora_config(adapters),
                         max_num_batched_tokens=256)
    try:
        health = engine.executor.health()[0]
        assert health["decode_graphs"] and health["piecewise_graphs"]
        runner = engine.executor.worker.runner
        assert runner.graphs.lora is not None and runner.pieces.lora is not None
        decode, pieces = [], []
        run_graphs, run_pieces = runner.graphs.run, runner.pieces.run
        runner.graphs.run = lambda seqs, *a: (decode.append([s.adapter for s in seqs])
                                             or run_graphs(seqs, *a))
        # The row slots come only with a step that has adapter rows (model_runner).
        runner.pieces.run = lambda *a: (pieces.append(a[3].tolist() if len(a) > 3 else [])
                                        or run_pieces(*a))
        assert engine_greedy(engine, mixed(), NEW) == want_tokens(oracle)
        assert staggered(engine, mixed(), NEW) == want_tokens(oracle)
        assert any(len(set(a)) == 3 for a in decode), decode
        assert any(len(set(s)) == 3 for s in pieces), pieces
        # Steps of base rows only replay the graphs captured without LoRA.
        graphs, base_replays = runner.graphs, []
        graphs.base_graphs = {b: (_Counted(g, base_replays), out)
                              for b, (g, out) in graphs.base_graphs.items()}
        assert engine_greedy(engine, [(p, None) for p in PROMPTS], NEW) == oracle[None][1]
        assert len(base_replays) >= NEW - 1
        assert engine.executor.health()[0]["compiles_since_warmup"] == 0
    finally:
        engine.shutdown()


class _Counted:
    """A captured graph whose replays are counted: appended to a list, or added up in a
    dict under `key`."""

    def __init__(self, graph, count, key=None) -> None:
        self.graph, self.count, self.key = graph, count, key

    def replay(self) -> None:
        if self.key is None:
            self.count.append(1)
        else:
            self.count[self.key] += 1
        self.graph.replay()
