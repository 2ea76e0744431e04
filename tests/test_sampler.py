"""The vectorised device sampler against a per-row reference, plus distribution, determinism
and poison-value checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sampler_reference import distribution

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SeqStep
from tpserve.layers.sampler import SampleRow, gumbel_noise, row_key, sample
from tpserve.worker.sampling import sample_tokens

VOCAB = 50


def _logits(n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _history(row: int, length: int = 12) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(100 + row)
    return tuple(torch.randint(0, VOCAB, (length,), generator=g).tolist())


MIXED = [
    SamplingParams(),
    SamplingParams(top_n_tokens=3),
    SamplingParams(repetition_penalty=1.3, top_n_tokens=2),
    SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.4),
    SamplingParams(do_sample=True, temperature=0.7, top_n_tokens=4),
    SamplingParams(do_sample=True, top_k=5),
    SamplingParams(do_sample=True, top_p=0.8, temperature=1.3),
    SamplingParams(do_sample=True, typical_p=0.6),
    SamplingParams(do_sample=True, top_k=10, top_p=0.9, typical_p=0.9, temperature=0.5,
                   repetition_penalty=1.2, frequency_penalty=0.3, top_n_tokens=5),
    SamplingParams(presence_penalty=1.5, top_n_tokens=3),
    SamplingParams(temperature=0.0, presence_penalty=-0.7, frequency_penalty=0.2),
    SamplingParams(logit_bias=((3, 9.0), (11, -100.0), (49, 2.5)), top_n_tokens=3),
    SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.4, presence_penalty=0.8,
                   logit_bias=((int(_history(13)[0]), -4.0), (7, 6.0)), top_n_tokens=2),
]


def _rows(params: list[SamplingParams], step: int = 0) -> list[SampleRow]:
    rows = []
    for i, p in enumerate(params):
        pen = bool(p.repetition_penalty or p.frequency_penalty or p.presence_penalty)
        rows.append(SampleRow(p, seed=1000 + i, step=step,
                              history=_history(i) if pen else None, num_generated=5))
    return rows


def test_matches_per_row_reference_for_every_rule():
    logits = _logits(len(MIXED))
    rows = _rows(MIXED)
    res = sample(logits, rows)
    assert res.token_ids.dtype == torch.int64 and res.logprobs.dtype == torch.float32
    assert res.top_ids.shape == (len(MIXED), 5)
    for i, r in enumerate(rows):
        ref = distribution(logits[i], r.params, list(r.history) if r.history else None, 5)
        tok = int(res.token_ids[i])
        if r.params.greedy:
            assert tok == int(ref.argmax())
        else:
            assert math.isfinite(float(ref[tok])), f"row {i} drew a masked token"
        # The reported logprob is that of the distribution the token came from.
        assert float(res.logprobs[i]) == pytest.approx(float(ref[tok]), abs=1e-5)
        k = r.params.top_n_tokens
        ref_lp, ref_ids = ref.topk(k) if k else (ref[:0], ref[:0].long())
        assert res.top_ids[i, :k].tolist() == ref_ids.tolist()
        torch.testing.assert_close(res.top_logprobs[i, :k], ref_lp, atol=1e-5, rtol=0)


def test_greedy_without_penalty_reports_raw_log_softmax():
    logits = _logits(4)
    res = sample(logits, [SampleRow(SamplingParams(top_n_tokens=2), 0, 0)] * 4)
    raw = logits.log_softmax(-1)
    assert res.token_ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(res.logprobs, raw.max(-1).values)
    torch.testing.assert_close(res.top_logprobs, raw.topk(2).values)


def test_raw_logprobs_rows_report_the_models_own_next_to_rows_that_do_not():
    """raw_logprobs (OpenAI's routes): the token is drawn as before, but it and its
    alternatives report the model's log_softmax, whatever the temperature, filters, penalties
    and biases; the other rows of the batch keep reporting the distribution drawn from."""
    import dataclasses

    raw_params = [dataclasses.replace(p, raw_logprobs=True, top_n_tokens=3) for p in MIXED]
    params = [q for pair in zip(raw_params, MIXED, strict=True) for q in pair]
    logits = _logits(len(params))
    rows = _rows(params)
    plain = sample(logits[1::2], rows[1::2])
    res = sample(logits, rows)
    torch.testing.assert_close(res.token_ids[1::2], plain.token_ids)  # draws are unchanged
    torch.testing.assert_close(res.logprobs[1::2], plain.logprobs)
    model = logits[0::2].log_softmax(-1)
    tokens = res.token_ids[0::2]
    torch.testing.assert_close(res.logprobs[0::2], model.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(res.top_logprobs[0::2, :3], model.topk(3).values)
    assert res.top_ids[0::2, :3].tolist() == model.topk(3).indices.tolist()
    for i, r in enumerate(rows[0::2]):  # drawn from the processed distribution, as before
        ref = distribution(logits[2 * i], r.params, list(r.history) if r.history else None, 5)
        assert math.isfinite(float(ref[int(tokens[i])]))
        if r.params.greedy:
            assert int(tokens[i]) == int(ref.argmax())


def test_no_top_n_gives_none():
    res = sample(_logits(2), _rows([SamplingParams(), SamplingParams(do_sample=True)]))
    assert res.top_ids is None and res.top_logprobs is None


def _frequencies(logits_row: torch.Tensor, p: SamplingParams, draws: int) -> torch.Tensor:
    rows = [SampleRow(p, seed=s, step=7) for s in range(draws)]
    tokens = sample(logits_row.expand(draws, -1).contiguous(), rows).token_ids
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).double()


@pytest.mark.parametrize("params", [
    SamplingParams(do_sample=True),
    SamplingParams(do_sample=True, temperature=0.6),
    SamplingParams(do_sample=True, top_k=3),
    SamplingParams(do_sample=True, top_p=0.7),
    SamplingParams(do_sample=True, typical_p=0.8, temperature=1.5),
], ids=["plain", "temperature", "top_k", "top_p", "typical_p"])
def test_draws_follow_the_filtered_distribution(params):
    # Chi-square over 20,000 seeds on an 8-token vocabulary; masked tokens never drawn.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    draws = 20_000
    freq = _frequencies(logits, params, draws)
    probs = distribution(logits, params).exp().double()
    assert freq[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep] * draws
    chi2 = float(((freq[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # The 99.99th percentile of chi-square is below dof + 6 sqrt(2 dof) + 10 for dof <= 7.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, freq, expected)


def test_different_steps_and_seeds_draw_independently():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(do_sample=True)
    by_step = [int(sample(logits, [SampleRow(p, 5, s)]).token_ids) for s in range(50)]
    by_seed = [int(sample(logits, [SampleRow(p, s, 3)]).token_ids) for s in range(50)]
    assert len(set(by_step)) > 40 and len(set(by_seed)) > 40


def test_seeded_row_draws_the_same_alone_and_inside_a_batch():
    logits = _logits(len(MIXED), vocab=VOCAB, seed=3)
    rows = _rows(MIXED, step=11)
    batch = sample(logits, rows)
    for i, r in enumerate(rows):
        alone = sample(logits[i:i + 1], [r])
        assert int(alone.token_ids) == int(batch.token_ids[i])
        assert float(alone.logprobs) == pytest.approx(float(batch.logprobs[i]), abs=1e-6)
    # And again, shuffled among other rows.
    order = list(reversed(range(len(rows))))
    again = sample(logits[order], [rows[i] for i in order])
    assert again.token_ids.flip(0).tolist() == batch.token_ids.tolist()


POISON = [
    SamplingParams(do_sample=True, temperature=5e-324),
    SamplingParams(do_sample=True, temperature=1e-38),
    SamplingParams(do_sample=True, temperature=1e40),
    SamplingParams(repetition_penalty=1e-40),
    SamplingParams(repetition_penalty=1e40),
    SamplingParams(do_sample=True, repetition_penalty=1e-40, top_p=0.5),
    SamplingParams(frequency_penalty=1e40),
    SamplingParams(do_sample=True, frequency_penalty=-1e40, temperature=1e-38),
    SamplingParams(presence_penalty=-1e40, logit_bias=((0, 1e40), (1, -1e40))),
    SamplingParams(do_sample=True, top_k=1, top_p=1e-9, typical_p=1e-9),
]


def test_poison_values_never_make_a_row_nan():
    logits = _logits(len(POISON) + 1)
    logits[-1] = float("-inf")  # a row whose model output is fully masked
    rows = _rows(POISON) + [SampleRow(SamplingParams(do_sample=True, top_n_tokens=2), 1, 0)]
    res = sample(logits, rows)
    assert torch.isfinite(res.logprobs).all(), res.logprobs
    assert not torch.isnan(res.top_logprobs).any()  # masked alternatives are -inf
    assert ((res.token_ids >= 0) & (res.token_ids < VOCAB)).all()
    # Near-zero temperatures are an arg-max.
    assert res.token_ids[:2].tolist() == logits[:2].argmax(-1).tolist()
    # A huge repetition penalty pushes every seen token below the unseen ones.
    assert int(res.token_ids[4]) not in _history(4)


def test_rows_left_without_a_finite_logit_fall_back_to_greedy_on_raw_logits():
    logits = _logits(3)
    logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    sampled = SamplingParams(do_sample=True, top_p=0.9, repetition_penalty=1.2)
    rows = [SampleRow(sampled, 0, 0, (1, 2), 0), SampleRow(sampled, 0, 0, (1, 2), 0),
            SampleRow(sampled, 0, 0, (1, 2), 0)]
    res = sample(logits, rows)
    safe = logits.nan_to_num(nan=-1e30, posinf=1e30, neginf=-1e30)
    assert res.token_ids[:2].tolist() == safe[:2].argmax(-1).tolist()
    assert torch.isfinite(res.logprobs).all()
    torch.testing.assert_close(res.logprobs[:2], safe[:2].log_softmax(-1).max(-1).values)


def test_seq_step_adapter_reads_back_tokens_logprobs_and_top_n():
    logits = _logits(3)
    seqs = [SeqStep(7, [1], 4, [0], True, SamplingParams(top_n_tokens=2)),
            SeqStep(8, [1], 4, [0], True, SamplingParams(do_sample=True), None, 2),
            SeqStep(9, [1], 4, [0], True, None)]
    out = sample_tokens(logits, seqs, default_seed=5)
    assert [t.seq_id for t in out] == [7, 8, 9]
    assert out[0].token_id == int(logits[0].argmax()) and len(out[0].top) == 2
    assert out[0].top[0][0] == out[0].token_id and out[2].top == []
    # Unseeded rows draw with default_seed + seq_id, keyed by tokens generated so far.
    same = sample(logits[1:2], [SampleRow(SamplingParams(do_sample=True), 13, 2)])
    assert out[1].token_id == int(same.token_ids)
    assert out[1].logprob == pytest.approx(float(same.logprobs))


@pytest.mark.gpu
def test_sampling_on_cuda_never_syncs_and_matches_the_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    logits = _logits(len(MIXED) + len(POISON), vocab=VOCAB, seed=5)
    rows = _rows(MIXED + POISON, step=2)
    cpu = sample(logits, rows)
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync raises
    try:
        res = sample(gpu_logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert res.token_ids.is_cuda
    assert res.token_ids.tolist() == cpu.token_ids.tolist()
    torch.testing.assert_close(res.logprobs.cpu(), cpu.logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow  # Triton's interpreter in a fresh process
def test_triton_gumbel_argmax_draws_what_the_torch_path_draws():
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    script = textwrap.dedent("""
        import torch
        from tpserve.kernels.triton_sampling import gumbel_argmax_kernel
        from tpserve.layers.sampler import gumbel_noise, row_key
        g = torch.Generator().manual_seed(0)
        f = torch.randn(64, 3000, generator=g)
        f[5] = float("-inf")           # fully masked: index 0, as torch's argmax
        f[6, 1000:] = float("-inf")    # masked tail
        f[7] = 0.0                     # all equal: the noise alone decides
        keys = torch.tensor([row_key(s, 3) for s in range(64)])
        ref = (f + gumbel_noise(keys, 3000)).argmax(-1)
        out = torch.empty(64, dtype=torch.int64)
        gumbel_argmax_kernel[(64,)](f, keys, out, 3000, f.stride(0), BLOCK=1024)
        print("same", out.tolist() == ref.tolist(), int(out[5]), int(out[6]) < 1000)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same True 0 True" in proc.stdout, proc.stdout


def test_float32_noise_for_devices_without_float64_matches_the_exact_one():
    keys = torch.tensor([row_key(s, 1) for s in range(200)])
    exact = gumbel_noise(keys, 500, exact=True)
    approx = gumbel_noise(keys, 500, exact=False)
    assert torch.isfinite(approx).all()
    torch.testing.assert_close(approx, exact, rtol=1e-6, atol=5e-6)  # measured: 2.9e-6
