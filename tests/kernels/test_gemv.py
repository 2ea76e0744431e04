"""The one-row GEMV (tpserve/kernels/gemv.py, triton_gemv.py) against F.linear in float64,
and how warmup chooses between it and F.linear.

The kernel runs on the CPU under Triton's interpreter when triton is installed (CI without
triton reports that test as skipped, with the reason) and on a CUDA machine (`-m gpu`). The
choice and the dispatch are checked on the CPU with stand-ins for the timer and the kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter import assert_no_failures_interpreted

from tpserve.kernels import gemv as G

# (N, K): even and ragged against every candidate tile's blocks; 1 output row; K below one
# K-block.
SHAPES = ((64, 2048), (13, 1100), (1, 256), (40, 100), (130, 1024))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def gemv_failures(device: str, dtypes, fn=None, tiles=G.CANDIDATES + (G.DEFAULT_TILE,)):
    """Every (shape, dtype, tile) whose relative error against float64 exceeds the dtype's
    tolerance (the rounding of one output to the dtype); [] when all pass."""
    fn = fn or G.gemv
    gen = torch.Generator().manual_seed(0)
    bad = []
    for dtype in dtypes:
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen).to(dtype).to(device)
            x = torch.randn(1, k, generator=gen).to(dtype).to(device)
            ref = F.linear(x.double(), w.double())
            for tile in tiles:
                out = fn(x, w, tile)
                assert out.dtype == dtype and out.shape == (1, n)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err <= TOLERANCE[dtype]:
                    bad.append(f"{n}x{k} {dtype} {tile.label()}: relative error {err:.2e}")
    return bad


def gated_reference(x: torch.Tensor, w: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) in float64, for w = [gate; up]."""
    g, u = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    act = F.gelu(g, approximate="tanh") if gelu_tanh else F.silu(g)
    return act * u


def gated_failures(device: str, dtypes, fn=None, tiles=G.CANDIDATES):
    """Every (shape, dtype, activation, tile) where the gated GEMV (one launch: [gate; up]
    projection and activation) is off the float64 reference by more than the dtype's
    tolerance, three roundings (gate, up, activation) instead of one, as a share of the
    outputs' scale (their largest value or the largest up value: a deep-negative gate makes
    an output ~1e-7, where a relative error means nothing); [] when all pass."""
    fn = fn or G.gated
    gen = torch.Generator().manual_seed(1)
    bad = []
    for dtype in dtypes:
        for n, k in SHAPES:
            w = torch.randn(2 * n, k, generator=gen).to(dtype).to(device)
            x = torch.randn(1, k, generator=gen).to(dtype).to(device)
            for gelu_tanh in (False, True):
                ref = gated_reference(x, w, gelu_tanh)
                up = F.linear(x.double(), w.double())[:, n:]
                scale = max(ref.abs().max().item(), up.abs().max().item())
                for tile in tiles:
                    out = fn(x, w, tile, gelu_tanh)
                    assert out.dtype == dtype and out.shape == (1, n)
                    err = (out.double() - ref).abs().max().item() / scale
                    if not err <= 3 * TOLERANCE[dtype]:
                        bad.append(f"{n}x{k} {dtype} gelu_tanh={gelu_tanh} {tile.label()}: "
                                   f"relative error {err:.2e}")
    return bad


def rms_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def folded_failures(device: str, dtypes, fn=None, tiles=G.CANDIDATES):
    """The GEMV's folded-norm extras (RMSNorm.fold_into) against float64: `rms_eps` (x
    divided by its root mean square first) and `residual` (added to the output). x is scaled
    far from unit size (x 30) so that a missing normalisation shows. [] when all pass."""
    fn = fn or G.gemv
    gen = torch.Generator().manual_seed(2)
    eps = 1e-5
    bad = []
    for dtype in dtypes:
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen).to(dtype).to(device)
            x = (torch.randn(1, k, generator=gen) * 30).to(dtype).to(device)
            res = torch.randn(1, n, generator=gen).to(dtype).to(device)
            cases = (("rms", (eps, None), F.linear(rms_reference(x, eps), w.double()), 1),
                     ("residual", (None, res),
                      F.linear(x.double(), w.double()) + res.double(), 2))
            for tile in tiles:
                for what, extra, ref, roundings in cases:
                    out = fn(x, w, tile, *extra).double()
                    assert out.shape == ref.shape
                    err = ((out - ref).norm() / ref.norm()).item()
                    if not err <= roundings * TOLERANCE[dtype]:
                        bad.append(f"{n}x{k} {dtype} {what} {tile.label()}: relative error "
                                   f"{err:.2e}")
    return bad


def test_the_folded_check_fails_a_missing_norm_or_add():
    def reference(x, w, tile, eps, res):
        return G.linear(x, w, None, eps, res)

    tiles = G.CANDIDATES[:1]
    assert folded_failures("cpu", (torch.float32,), reference, tiles) == []
    no_norm = folded_failures("cpu", (torch.float32,), lambda x, w, t, eps, res:
                              reference(x, w, t, None, res), tiles)
    assert len(no_norm) == len(SHAPES) and all(" rms " in b for b in no_norm)
    no_add = folded_failures("cpu", (torch.float32,), lambda x, w, t, eps, res:
                             reference(x, w, t, eps, None), tiles)
    assert len(no_add) == len(SHAPES) and all("residual" in b for b in no_add)


def test_the_gated_check_fails_swapped_halves_and_a_wrong_activation():
    def swapped(x, w, tile, gelu_tanh):
        g, u = w.chunk(2)
        return gated_reference(x, torch.cat([u, g]), gelu_tanh).to(x.dtype)

    def always_silu(x, w, tile, gelu_tanh):
        return gated_reference(x, w, False).to(x.dtype)

    tiles = G.CANDIDATES[:1]
    assert len(gated_failures("cpu", (torch.float32,), swapped, tiles)) >= 2 * len(SHAPES) - 2
    wrong_act = gated_failures("cpu", (torch.float32,), always_silu, tiles)
    # Every shape but the one-output one (where silu and GELU happen to nearly agree).
    assert len(wrong_act) >= len(SHAPES) - 1 and all("gelu_tanh=True" in b for b in wrong_act)
    exact = lambda x, w, tile, gelu_tanh: gated_reference(x, w, gelu_tanh).to(x.dtype)  # noqa: E731
    assert gated_failures("cpu", (torch.float32,), exact, tiles) == []


def test_the_check_fails_a_gemv_that_drops_the_last_k_block():
    def drops_tail(x, w, tile):
        k = w.shape[1] // tile.block_k * tile.block_k
        return F.linear(x[:, :k], w[:, :k])

    bad = gemv_failures("cpu", (torch.float32,), fn=drops_tail)
    assert any("13x1100" in b for b in bad) and any("40x100" in b for b in bad)
    assert not any(b.startswith("64x2048") for b in bad)  # whole blocks lose nothing
    assert gemv_failures("cpu", (torch.float32,), fn=lambda x, w, t: F.linear(x, w)) == []


@pytest.mark.slow  # Triton's interpreter
def test_triton_gemv_under_the_interpreter():
    assert_no_failures_interpreted("test_gemv", 'gemv_failures("cpu", (torch.float32, torch.float16))')


@pytest.mark.slow  # Triton's interpreter
def test_triton_folded_gemv_under_the_interpreter():
    assert_no_failures_interpreted("test_gemv",
                                   'folded_failures("cpu", (torch.float32, torch.float16))')


@pytest.mark.slow  # Triton's interpreter
def test_triton_gated_gemv_under_the_interpreter():
    assert_no_failures_interpreted("test_gemv",
                                   'gated_failures("cpu", (torch.float32, torch.float16))')


@pytest.mark.gpu
def test_triton_gemv_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert gemv_failures("cuda", (torch.float32, torch.bfloat16, torch.float16)) == []
    assert gated_failures("cuda", (torch.float32, torch.bfloat16, torch.float16)) == []
    assert folded_failures("cuda", (torch.float32, torch.bfloat16, torch.float16)) == []
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    choice = G.choose([w])
    assert choice is not None and choice.vendor_us > 0 and choice.us <= choice.vendor_us


def test_the_cpu_keeps_f_linear():
    w = torch.randn(8, 16)
    assert G.unavailable(w.device, torch.bfloat16) == "no Triton GEMV on cpu"
    assert G.choose([w]) is None
    assert "float32" in G.unavailable(torch.device("cuda"), torch.float32)


@pytest.fixture
def fake_device(monkeypatch):
    """choose() on the CPU: every device counts as able, the 'kernel' is F.linear plus a
    per-tile error, and the timer reads a table of microseconds per tile."""
    monkeypatch.setattr(G, "unavailable", lambda device, dtype: None)
    monkeypatch.setattr(G, "_CHOSEN", {})
    state = {"wrong": set(), "broken": set(), "calls": []}

    def fake_gemv(x, w, tile=G.DEFAULT_TILE, rms_eps=None, residual=None):
        state["calls"].append(tile)
        if tile in state["broken"]:
            raise RuntimeError("out of shared memory")
        y = F.linear(x.reshape(1, -1), w)
        return y * 1.5 if tile in state["wrong"] else y

    monkeypatch.setattr(G, "gemv", fake_gemv)
    return state


def timer_from(times: dict):
    """A timer that identifies what it times by running it once and seeing which tile (or
    F.linear: no tile) the fake kernel was called with."""
    def timer(run, n_calls):
        before = len(calls)
        run()
        assert n_calls >= 1
        tile = calls[-1] if len(calls) > before else None
        return times[tile]
    calls: list = []
    return timer, calls


def test_choose_keeps_the_fastest_path(fake_device):
    a, b, c, d = G.CANDIDATES
    timer, calls = timer_from({None: 10.0, a: 9.0, b: 7.5, c: 8.0, d: 12.0})
    fake_device["calls"] = calls
    w = torch.randn(32, 64)
    choice = G.choose([w, torch.randn(32, 64)], timer)
    assert choice.tile == b and choice.us == 7.5 and choice.vendor_us == 10.0
    assert "Triton GEMV" in choice.describe(32, 64)
    # Cached per device, dtype and shape: a second layer of that shape is not timed again.
    assert G.choose([torch.randn(32, 64)], lambda run, n: pytest.fail("timed twice")) is choice


def test_choose_keeps_f_linear_when_no_tile_is_faster(fake_device):
    timer, calls = timer_from({None: 5.0, **{t: 6.0 for t in G.CANDIDATES}})
    fake_device["calls"] = calls
    choice = G.choose([torch.randn(16, 32)], timer)
    assert choice.tile is None and "F.linear" in choice.describe(16, 32)


def test_choose_skips_tiles_that_fail_or_disagree(fake_device, caplog):
    a, b, c, d = G.CANDIDATES
    fake_device["broken"].add(a)
    fake_device["wrong"].add(b)
    timer, calls = timer_from({None: 10.0, a: 1.0, b: 1.0, c: 9.0, d: 9.5})
    fake_device["calls"] = calls
    with caplog.at_level("WARNING", logger="tpserve.kernels.gemv"):
        choice = G.choose([torch.randn(16, 32)], timer)
    assert choice.tile == c
    assert "out of shared memory" in caplog.text and "relative error" in caplog.text


def test_linear_dispatches_one_row_only(fake_device):
    w = torch.randn(6, 4)
    tile = G.CANDIDATES[0]
    one = torch.randn(1, 1, 4)  # [batch, tokens, features] with one row
    assert torch.allclose(G.linear(one, w, tile), F.linear(one, w))
    assert fake_device["calls"] == [tile]
    two = torch.randn(2, 4)
    assert torch.allclose(G.linear(two, w, tile), F.linear(two, w))
    assert G.linear(one, w, None).shape == (1, 1, 6)
    assert fake_device["calls"] == [tile]  # neither two rows nor no tile took the GEMV


def test_assign_sets_the_tile_on_linear_layers_and_the_lm_head(fake_device):
    from tpserve.distributed import TPInfo, reset_tp, set_tp
    from tpserve.layers.embedding import ParallelLMHead
    from tpserve.layers.linear import ColumnParallelLinear

    set_tp(TPInfo(0, 1))
    try:
        _assign_and_check(fake_device, [ColumnParallelLinear(32, 48, prefix="a"),
                                        ColumnParallelLinear(32, 48, prefix="b"),
                                        ParallelLMHead(100, 32)])
    finally:
        reset_tp()


def _assign_and_check(fake_device, layers):
    for m in layers:
        m.weight.data.normal_()
    fast = G.CANDIDATES[2]
    timer, calls = timer_from({None: 10.0, **{t: (1.0 if t == fast else 20.0)
                                               for t in G.CANDIDATES}})
    fake_device["calls"] = calls
    real_choose = G.choose
    seen: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "choose", lambda ws: seen.append(len(ws)) or real_choose(ws, timer))
        chosen = G.assign([*layers, torch.nn.ReLU()])
    assert set(chosen) == {(48, 32), (100, 32)}
    assert sorted(seen) == [1, 2]  # the two 48x32 layers timed together, once
    assert all(m.gemv_tile == fast for m in layers)
    hidden = torch.randn(1, 32)  # the LM head's one-row logits go through the GEMV too
    calls.clear()
    assert torch.allclose(layers[2].compute_logits(hidden), F.linear(hidden, layers[2].weight)[
        :, :100])
    assert calls == [fast]


def test_choose_keeps_f_linear_when_timing_fails(fake_device, caplog):
    def out_of_memory(run, n_calls):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    with caplog.at_level("WARNING", logger="tpserve.kernels.gemv"):
        assert G.choose([torch.randn(16, 32)], out_of_memory) is None
    assert "stays on F.linear" in caplog.text and "out of memory" in caplog.text
    assert G.choose([torch.randn(16, 32)], lambda run, n: pytest.fail("timed again")) is None


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) only on CUDA 9.0+: the CPU (the
    interpreter's device) and a GPU below sm_90 launch without it, and TPSERVE_PDL=0 turns
    it off everywhere."""
    from tpserve.kernels import pdl

    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    pdl.enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.enabled(torch.device("cuda", 0))
    pdl.enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.1")  # graph capture of PDL needs 12.3
    assert not pdl.enabled(torch.device("cuda", 0))
    pdl.enabled.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(pdl, "_DISABLED", True)
    assert not pdl.enabled(torch.device("cuda", 0))
    pdl.enabled.cache_clear()


@pytest.mark.gpu
def test_a_chain_of_pdl_kernels_in_a_cuda_graph_matches_torch():
    """norm -> GEMV -> activation -> GEMV -> norm, captured in one CUDA graph with
    programmatic dependent launch where the GPU has it, replayed on fresh inputs: every
    replay equals the same chain computed eagerly by torch. A kernel that read its input
    before the previous kernel's writes were visible (a wait in the wrong place) would fail
    here with stale values."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tpserve.kernels import fused_ops as fo

    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, inter = 4096, 14336
    gen = torch.Generator(device=dev).manual_seed(0)
    w_up = torch.randn(2 * inter, hidden, device=dev, dtype=dt, generator=gen) * 0.02
    w_down = torch.randn(hidden, inter, device=dev, dtype=dt, generator=gen) * 0.02
    norm_w = torch.rand(hidden, device=dev, dtype=dt, generator=gen) + 0.5
    x = torch.zeros(1, hidden, device=dev, dtype=dt)
    res = torch.zeros(1, hidden, device=dev, dtype=dt)
    up, down = G.CANDIDATES[0], G.CANDIDATES[1]

    def chain():
        h, r = fo.add_rms_norm_triton(x, res, norm_w, 1e-5)
        a = fo.gated_act_triton(G.gemv(h, w_up, up), False)
        return fo.add_rms_norm_triton(G.gemv(a, w_down, down), r, norm_w, 1e-5)

    def reference():
        h, r = fo.add_rms_norm_torch(x, res, norm_w, 1e-5)
        a = fo.gated_act_torch(F.linear(h, w_up), F.silu)
        return fo.add_rms_norm_torch(F.linear(a, w_down), r, norm_w, 1e-5)

    graph, (out, out_res) = G.capture(chain)
    for _ in range(20):
        x.copy_(torch.randn(1, hidden, device=dev, dtype=dt, generator=gen))
        res.copy_(torch.randn(1, hidden, device=dev, dtype=dt, generator=gen))
        graph.replay()
        ref, ref_res = reference()
        for got, want in ((out, ref), (out_res, ref_res)):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 2e-2, err


@pytest.mark.gpu
def test_a_folded_layer_in_a_cuda_graph_matches_torch():
    """A decoder layer's projections with folded-norm extras (QKV-shaped GEMV normalising the
    stream, o_proj and down_proj adding to it), captured in one CUDA graph with programmatic dependent launch where
    the GPU has it and replayed on fresh streams: each replay matches the torch reference
    path (`linear` without tiles). A read of the stream before its writer finished would
    show as stale values here."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, inter, eps = 4096, 14336, 1e-5
    gen = torch.Generator(device=dev).manual_seed(0)

    def weight(n, k):
        return torch.randn(n, k, device=dev, dtype=dt, generator=gen) * 0.02

    w_qkv, w_o = weight(6144, hidden), weight(hidden, 4096)
    w_up, w_down = weight(2 * inter, hidden), weight(hidden, inter)
    h = torch.zeros(1, hidden, device=dev, dtype=dt)
    tile = G.CANDIDATES[1]

    def layer(gemv_tile):
        qkv = G.linear(h, w_qkv, gemv_tile, rms_eps=eps)
        h2 = G.linear(qkv[:, :4096], w_o, gemv_tile, residual=h)
        if gemv_tile is None:
            a = torch_gated(G.linear(h2, w_up, None), False)
        else:
            a = G.gated(h2, w_up, gemv_tile, False)
        return G.linear(a, w_down, gemv_tile, residual=h2)

    graph, out = G.capture(lambda: layer(tile))
    for _ in range(20):
        h.copy_(torch.randn(1, hidden, device=dev, dtype=dt, generator=gen) * 3)
        graph.replay()
        want = layer(None).float()
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 2e-2, err


def test_pdl_is_for_launches_of_a_few_rows(monkeypatch):
    from tpserve.kernels import pdl

    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert pdl.launch(cuda) == pdl.launch(cuda, pdl.MAX_ROWS) == {"PDL": True,
                                                                   "launch_pdl": True}
    assert pdl.launch(cuda, pdl.MAX_ROWS + 1) == {"PDL": False}


def torch_gated(y: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    g, u = y.chunk(2, dim=-1)
    return (F.gelu(g, approximate="tanh") if gelu_tanh else F.silu(g)) * u


def test_a_gated_mlp_takes_the_fused_launch_where_warmup_timed_it_faster(fake_device, caplog):
    """GatedMLP's [gate; up] projection: warmup (assign) times the fused launch against
    F.linear + the activation kernel, apart from the plain GEMV's choice (here F.linear
    beats every plain tile, yet a fused tile beats the two launches); a wrong fused tile is
    skipped; a one-row forward then takes the fused launch, more rows the two launches."""
    from tpserve.distributed import TPInfo, reset_tp, set_tp

    set_tp(TPInfo(0, 1))  # row-parallel down_proj reads it in forward too
    try:
        _check_gated_mlps(fake_device, caplog)
    finally:
        reset_tp()


def _check_gated_mlps(fake_device, caplog):
    from tpserve.models.llama import GatedMLP

    a, b, c, d = G.CANDIDATES
    ran: list = []  # what each timed or forward call launched: (kind, tile)
    wrong = {b}

    def fake_gemv(x, w, tile=G.DEFAULT_TILE, rms_eps=None, residual=None):
        ran.append(("plain", tile))
        return F.linear(x.reshape(1, -1), w)

    def fake_gated(x, w, tile, gelu_tanh, rms_eps=None):
        ran.append(("gated", tile, gelu_tanh))
        y = gated_reference(x.reshape(1, -1), w, gelu_tanh).to(x.dtype)
        return y * 1.5 if tile in wrong else y

    def fake_act(y, gelu_tanh):
        ran.append(("act", None))
        return torch_gated(y, gelu_tanh)

    times = {None: 10.0, ("act", None): 12.0, **{("plain", t): 11.0 for t in G.CANDIDATES},
             ("gated", a): 11.5, ("gated", b): 1.0, ("gated", c): 9.0, ("gated", d): 13.0}

    def timer(run, n_calls):
        before = len(ran)
        run()
        return times[ran[-1][:2] if len(ran) > before else None]

    mlps = [GatedMLP(16, 24, "silu", "m0"), GatedMLP(16, 24, "gelu_pytorch_tanh", "m1"),
            GatedMLP(16, 24, "relu", "m2")]
    for m in mlps:
        for p in m.parameters():
            p.data.normal_()
    assert [getattr(m.gate_up_proj, "gemv_gated", None) for m in mlps] == [False, True, None]
    real_choose, real_gated = G.choose, G.choose_gated
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "gemv", fake_gemv)
        mp.setattr(G, "gated", fake_gated)
        mp.setattr("tpserve.kernels.fused_ops.gated_act_triton", fake_act)
        mp.setattr("tpserve.kernels.fused_ops.use_triton", lambda t: True)
        mp.setattr(G, "choose", lambda ws: real_choose(ws, timer))
        mp.setattr(G, "choose_gated", lambda ws, gelu: real_gated(ws, gelu, timer))
        with caplog.at_level("WARNING", logger="tpserve.kernels.gemv"):
            G.assign([m.gate_up_proj for m in mlps])
        assert "relative error" in caplog.text  # tile b was fastest but wrong: skipped
        assert [m.gate_up_proj.gemv_tile for m in mlps] == [None] * 3  # F.linear won
        assert [getattr(m.gate_up_proj, "gemv_gated_tile", None) for m in mlps] == [c, c, None]
        one, many = torch.randn(1, 1, 16), torch.randn(3, 16)
        ran.clear()
        for m in mlps:
            assert torch.allclose(m(one), m.down_proj(m.act(F.linear(
                one, m.gate_up_proj.weight))), atol=1e-5)
            assert torch.allclose(m(many), m.down_proj(m.act(F.linear(
                many, m.gate_up_proj.weight))), atol=1e-5)
        # One-row forwards of the two fusable MLPs took the fused launch, with their own
        # activation; everything else went through F.linear and the activation.
        assert [r for r in ran if r[0] == "gated"] == [("gated", c, False), ("gated", c, True)]
        # Where no fused tile beats the two launches, the two launches stay.
        times.update({("gated", a): 20.0, ("gated", c): 20.0})
        mp.setattr(G, "_CHOSEN", {})
        G.assign([mlps[0].gate_up_proj])
        assert mlps[0].gate_up_proj.gemv_gated_tile is None
        # With the fused kernels off (TPSERVE_FUSED=0) the fusion is not even timed.
        times.update({("gated", c): 1.0})
        mp.setattr(G, "_CHOSEN", {})
        mp.setattr("tpserve.kernels.fused_ops.use_triton", lambda t: False)
        G.assign([mlps[1].gate_up_proj])
        assert mlps[1].gate_up_proj.gemv_gated_tile is None
