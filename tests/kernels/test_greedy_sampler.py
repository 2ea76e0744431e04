"""The greedy sampler's two-pass arg-max + log-probability (kernels/triton_sampling.py,
fused_ops.greedy_triton) against torch's argmax and log_softmax: ties, -inf, +inf and NaN
logits, vocabularies that end inside a chunk, several rows. Under Triton's interpreter on
the CPU when triton is installed (CI without triton reports the test as skipped, with the
reason), and on CUDA (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch
from interpreter import assert_no_failures_interpreted


def greedy_failures(device: str, fn=None,
                    dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> list[str]:
    """Rows where fn(x) = (token, logp) differs from torch on x widened to float32 (what the
    sampler computed before it read the model's dtype): the token exactly, logp within 1e-5
    (NaN where torch gives NaN). Logits in float32 and, as the LM head writes them, in
    bfloat16 and float16 (many ties there: the first index must win them)."""
    from tpserve.kernels.fused_ops import GREEDY_CHUNK, greedy_triton

    fn = fn or greedy_triton
    gen = torch.Generator().manual_seed(0)
    bad = []
    for dtype in dtypes:
        for vocab in (17, GREEDY_CHUNK, GREEDY_CHUNK + 5, 3 * GREEDY_CHUNK - 1):
            x = torch.randn(6, vocab, generator=gen) * 4
            x[1, vocab // 2] = x[1].max() + 1  # a clear maximum in the middle
            x[1, vocab - 1] = x[1, vocab // 2]  # ... tied at the end: the first index wins
            x[2] = float("-inf")  # no finite logit
            x[3, : vocab // 2] = float("-inf")
            x[4, vocab // 3] = float("nan")
            x[5, vocab - 1] = float("inf")
            x = x.to(device=device, dtype=dtype)
            tok, lp = fn(x)
            wide = x.float()
            ref_tok = wide.argmax(-1)
            ref_lp = wide.log_softmax(-1).gather(1, ref_tok[:, None])[:, 0]
            for r in range(x.shape[0]):
                t, rt = int(tok[r]), int(ref_tok[r])
                a, b = float(lp[r]), float(ref_lp[r])
                same_lp = (a != a and b != b) or abs(a - b) <= 1e-5 * max(1.0, abs(b))
                if t != rt or not same_lp:
                    bad.append(f"{dtype} vocab {vocab} row {r}: token {t} vs {rt}, "
                               f"logp {a} vs {b}")
    return bad


def test_the_check_catches_a_wrong_greedy():
    def last_index_on_ties(x):
        flipped = x.flip(-1)
        tok = x.shape[1] - 1 - flipped.argmax(-1)
        return tok, x.log_softmax(-1).gather(1, tok[:, None])[:, 0]

    def softmax_not_log(x):
        tok = x.argmax(-1)
        return tok, x.softmax(-1).gather(1, tok[:, None])[:, 0]

    def log_softmax_in_the_input_dtype(x):
        tok = x.argmax(-1)
        return tok, x.log_softmax(-1).gather(1, tok[:, None])[:, 0].float()

    assert any("row 1:" in b for b in greedy_failures("cpu", last_index_on_ties))
    assert greedy_failures("cpu", softmax_not_log)
    assert greedy_failures("cpu", log_softmax_in_the_input_dtype, (torch.bfloat16,))
    exact = lambda x: (x.float().argmax(-1),  # noqa: E731
                       x.float().log_softmax(-1).gather(1, x.float().argmax(-1)[:, None])[:, 0])
    assert greedy_failures("cpu", exact) == []


@pytest.mark.slow  # Triton's interpreter
def test_greedy_kernels_under_the_interpreter():
    assert_no_failures_interpreted("test_greedy_sampler", 'greedy_failures("cpu")')


@pytest.mark.gpu
def test_greedy_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert greedy_failures("cuda") == []
