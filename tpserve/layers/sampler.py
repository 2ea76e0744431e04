"""Turns the last-position logits of a step into next tokens, all rows at once, on the device.

`sample` issues no host sync: per-row parameters (and the token histories that penalties
need) reach the device in one copy, every rule is a masked tensor op over the whole batch, and
randomness is a counter-based Gumbel-max keyed by (seed, step), so a seeded row draws the same
token whatever else shares its batch and nothing is kept between steps. The caller reads the
result back once (tpserve/worker/sampling.py).

Numerics: no accepted parameter may turn a row into NaN and poison the batch. Temperatures and
penalties are clamped to ranges where float32 stays finite, +inf is clamped to a large finite
value, and a row that still has no finite logit (or a NaN: the model's doing) falls back to
greedy on its raw logits, with NaN and infinities replaced by large finite values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.engine.request import SamplingParams
from tpserve.kernels.fused_ops import greedy_triton, gumbel_argmax_triton, use_triton

# Temperatures below this already make the draw an arg-max for any real logit gap, and
# dividing by them keeps float32 finite; above the upper one every row is uniform anyway.
_MIN_TEMPERATURE, _MAX_TEMPERATURE = 1e-5, 1e30
_MIN_REP_PENALTY, _MAX_REP_PENALTY = 1e-6, 1e6
_MAX_FREQ_PENALTY = 1e20
_BIG = 1e30  # stand-in for +inf: large, but sums of a few stay finite in float32
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_MAX_BIAS = 1e20  # |logit_bias| (OpenAI allows +-100); keeps sums finite in float32
_FLOATS, _INTS = 6, 6  # packed columns per row: see _pack


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    seed: int  # request seed (engine fills a random one for unseeded sampling)
    step: int  # tokens this sequence generated so far (keys per-token randomness)
    history: tuple[int, ...] | None = None  # prompt+generated ids, only when a penalty is set
    num_generated: int = 0  # history[-num_generated:] are the generated ids
    # Guided requests: int32 words of allowed tokens (bit i of word w: token 32 * w + i).
    allowed: np.ndarray | None = None


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [n] int64, on the logits' device
    logprobs: torch.Tensor  # [n] float32, log p of the chosen token
    top_ids: torch.Tensor | None  # [n, k] int64, k = max top_n_tokens in the batch
    top_logprobs: torch.Tensor | None  # [n, k] float32


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=65536)
def _seed_mix(seed: int) -> int:
    # Seeds repeat on every step of a request: hash each once on the host.
    return _splitmix64(seed & _M64)


def _key32(lo, hi, step):
    """The 32-bit key of one draw from the seed's hash halves and the step (ints or int64
    tensors): the same arithmetic on the host (row_key) and on the device."""
    if isinstance(lo, int):
        return _mix32_int(_mix32_int(lo ^ (step * 0x9E3779B1 & _M32)) ^ hi)
    return _mix32(_mix32(lo ^ _mul32(step, 0x9E3779B1)) ^ hi)


def row_key(seed: int, step: int) -> int:
    """32-bit key of the draw of (seed, step): what the sampler computes on the device."""
    mixed = _seed_mix(seed)
    return _key32(mixed & _M32, mixed >> 32, step & _M32)


def _mix32_int(h: int) -> int:
    h ^= h >> 16
    h = h * 0x85EBCA6B & _M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _M32
    return h ^ (h >> 16)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for 0 <= h < 2**32 without int64 overflow (split in 16-bit halves)."""
    lo = (h & 0xFFFF) * c
    hi = ((h >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser: a bijection on 32 bits with full avalanche.
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int, exact: bool | None = None) -> torch.Tensor:
    """[n, vocab] standard Gumbel noise (float32), a pure function of each row's key and the
    token id; kernels/triton_sampling.py computes the same values.

    exact (default: when the device has float64) transforms in float64; otherwise in float32
    with a series for small draws, within ~1e-6 of it (Intel Arc GPUs lack float64)."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _mix32(_mix32(keys[:, None] ^ _mul32(idx, 0x9E3779B1)[None, :]))
    # w is uniform on (0, 1) with fine resolution near 0, where the exponential draw
    # -log(1 - w) is small and the Gumbel value large: the end that decides the arg-max.
    if exact if exact is not None else _has_float64(keys.device):
        # float64, and a series below 1e-6, keep that end exact to float32.
        w = ((h.double() + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24)
        e = torch.where(w < 1e-6, w + 0.5 * w * w, -torch.log(1.0 - w))
        return (-torch.log(e)).float()
    w = (h.float() + 0.5) * 2.0**-32
    # 1 - w from the integer complement: no cancellation when w is large.
    rest = ((_M32 - h).float() + 0.5) * 2.0**-32
    series = w * (1 + w * (1 / 2 + w * (1 / 3 + w * (1 / 4 + w / 5))))
    e = torch.where(w < 1e-2, series, -torch.log(rest))
    return -torch.log(e)


def _has_float64(device: torch.device) -> bool:
    from tpserve.kernels.capabilities import device_has_float64

    return device_has_float64(device)


def gumbel_argmax(f: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax(f + gumbel_noise(keys)) per row: one Triton pass on CUDA (and XPU with float64),
    else torch."""
    if use_triton(f) and _has_float64(f.device):
        return gumbel_argmax_triton(f, keys)
    return (f + gumbel_noise(keys, f.shape[1])).argmax(-1)


@dataclass(frozen=True)
class _Packed:
    """What _pack wrote after the per-row columns: nh (row, id) pairs of seen tokens
    (repetition penalty), ng of generated tokens (frequency and presence penalties) and
    nb logit biases (row, id, value)."""

    nh: int
    ng: int
    nb: int

    def __bool__(self) -> bool:
        return bool(self.nh or self.ng or self.nb)


def _pack(rows: list[SampleRow]) -> tuple[torch.Tensor, _Packed]:
    """One int64 host tensor: per-row floats (float32 bits), per-row ints, then the
    histories and biases (_Packed)."""
    n = len(rows)
    floats, ints = [], []
    hist_ids: list[int] = []
    hist_rows: list[int] = []
    gen_ids: list[int] = []
    gen_rows: list[int] = []
    bias_ids: list[int] = []
    bias_rows: list[int] = []
    bias_vals: list[float] = []
    for i, r in enumerate(rows):
        p = r.params
        greedy = p.greedy
        t = 1.0 if p.temperature is None or greedy else p.temperature
        rp = p.repetition_penalty or 1.0
        fp = p.frequency_penalty or 0.0
        pp = p.presence_penalty or 0.0
        floats += [min(max(t, _MIN_TEMPERATURE), _MAX_TEMPERATURE),
                   1.0 if p.top_p is None or greedy else p.top_p,
                   1.0 if p.typical_p is None or greedy else p.typical_p,
                   min(max(rp, _MIN_REP_PENALTY), _MAX_REP_PENALTY),
                   min(max(fp, -_MAX_FREQ_PENALTY), _MAX_FREQ_PENALTY),
                   min(max(pp, -_MAX_FREQ_PENALTY), _MAX_FREQ_PENALTY)]
        mixed = _seed_mix(r.seed)
        ints += [int(greedy), 0 if p.top_k is None or greedy else p.top_k, mixed & _M32,
                 mixed >> 32, r.step & _M32, int(p.raw_logprobs)]
        if r.history and rp != 1.0:
            uniq = set(r.history)
            hist_ids += uniq
            hist_rows += [i] * len(uniq)
        if r.history and (fp or pp) and r.num_generated:
            gen = r.history[len(r.history) - r.num_generated:]
            gen_ids += gen
            gen_rows += [i] * len(gen)
        for tid, value in p.logit_bias:
            bias_ids.append(tid)
            bias_rows.append(i)
            bias_vals.append(min(max(value, -_MAX_BIAS), _MAX_BIAS))
    head = torch.empty(n, _FLOATS + _INTS, dtype=torch.int64)
    # float32 bits as signed int32 values: the device reinterprets them without float64.
    head[:, :_FLOATS] = torch.tensor(floats, dtype=torch.float32).view(torch.int32) \
        .view(n, _FLOATS)
    head[:, _FLOATS:] = torch.tensor(ints, dtype=torch.int64).view(n, _INTS)
    bias_bits = torch.tensor(bias_vals, dtype=torch.float32).view(torch.int32).tolist()
    tail = torch.tensor(hist_ids + hist_rows + gen_ids + gen_rows + bias_ids + bias_rows
                        + bias_bits, dtype=torch.int64)
    return torch.cat([head.view(-1), tail]), _Packed(len(hist_ids), len(gen_ids), len(bias_ids))


def _to_device(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return buf
    if device.type == "cuda":
        buf = buf.pin_memory()  # a pinned source makes the copy asynchronous: no host sync
    return buf.to(device, non_blocking=True)


def _penalise(x: torch.Tensor, d: torch.Tensor, fl: torch.Tensor, packed: _Packed
              ) -> torch.Tensor:
    """Logit biases, then the repetition penalty, then frequency and presence penalties
    (the order of vLLM's and OpenAI's descriptions: biases shift logits before any
    penalty looks at their sign)."""
    n, vocab = x.shape
    nh, ng, nb = packed.nh, packed.ng, packed.nb
    tail = d[n * (_FLOATS + _INTS):]
    # Flat scatters (row * vocab + id): unlike index_put with accumulate, they never sync.
    if nb:
        b = tail[2 * nh + 2 * ng:]
        flat = b[nb:2 * nb] * vocab + b[:nb]
        values = b[2 * nb:3 * nb].to(torch.int32).view(torch.float32).to(x.dtype)
        x = x.reshape(-1).index_add(0, flat, values).view(n, vocab)
    if nh:
        flat = tail[nh:2 * nh] * vocab + tail[:nh]
        seen = torch.zeros(n * vocab, dtype=torch.bool, device=x.device)
        seen = seen.scatter(0, flat, True).view(n, vocab)
        rp = fl[:, 3:4]
        x = torch.where(seen, torch.where(x < 0, x * rp, x / rp), x)
    if ng:
        flat = tail[2 * nh + ng:2 * nh + 2 * ng] * vocab + tail[2 * nh:2 * nh + ng]
        counts = torch.zeros(n * vocab, dtype=x.dtype, device=x.device)
        counts.scatter_add_(0, flat, torch.ones(ng, dtype=x.dtype, device=x.device))
        counts = counts.view(n, vocab)
        x = x - fl[:, 4:5] * counts - fl[:, 5:6] * (counts > 0).to(x.dtype)
    return x.clamp(max=_BIG)


def _filter(x: torch.Tensor, fl: torch.Tensor, top_k: torch.Tensor, any_k: bool,
            any_p: bool, any_typical: bool) -> torch.Tensor:
    """Temperature, then top-k, top-p and typical-p masks, in transformers' warper order."""
    ninf = float("-inf")
    x = (x / fl[:, 0:1]).clamp(max=_BIG)
    vocab = x.shape[-1]
    if any_k or any_p:
        s, order = x.sort(-1, descending=True)
        if any_k:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = s.gather(1, (k - 1)[:, None])
            s = s.masked_fill(s < kth, ninf)
        if any_p:
            top_p = fl[:, 1:2]
            probs = s.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
            drop = (before >= top_p) & (top_p < 1.0)
            drop[:, 0] = False  # always keep the most likely token
            s = s.masked_fill(drop, ninf)
        x = torch.empty_like(x).scatter_(1, order, s)
    if any_typical:
        typical = fl[:, 2:3]
        logp = x.log_softmax(-1)
        ent = -(logp.exp() * logp).nansum(-1, keepdim=True)
        shifted = (-logp - ent).abs()
        s_sorted, order = shifted.sort(-1)
        cum = logp.exp().gather(1, order).cumsum(-1)
        last = (cum < typical).sum(-1, keepdim=True).clamp(max=vocab - 1)
        drop = (shifted > s_sorted.gather(1, last)) & (typical < 1.0)
        x = x.masked_fill(drop, ninf)
    return x


def _allowed(rows: list[SampleRow], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] bool: the tokens each row may take (every token for an unguided row), from
    the rows' bitmasks in one host-to-device copy, unpacked on the device."""
    words = -(-vocab // 32)
    host = np.full((len(rows), words), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        if r.allowed is not None:
            k = min(words, r.allowed.shape[0])
            host[i, :k] = r.allowed[:k]
            host[i, k:] = 0  # ids past the grammar's vocabulary: never allowed
    # Unpacked a byte at a time (the words' little-endian bytes: token 8 b + j is bit j of
    # byte b), so the device's temporary is one byte per token, not four.
    d = _to_device(torch.from_numpy(host.astype("<i4", copy=False).view(np.uint8)), device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (d[:, :, None] >> shifts) & 1
    return bits.view(len(rows), words * 32)[:, :vocab].bool()


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Next token per row of logits [len(rows), vocab]; no host sync, results on the device."""
    n, vocab = logits.shape
    if n == 0 or not rows:
        empty = torch.empty(0, dtype=torch.int64, device=logits.device)
        return SampleResult(empty, empty.float(), None, None)
    top_n = max(r.params.top_n_tokens for r in rows)
    sampled = [not r.params.greedy for r in rows]
    penalised = any(r.params.logit_bias or r.history and r.params.needs_history
                    for r in rows)
    guided = any(r.allowed is not None for r in rows)
    if not (penalised or any(sampled) or top_n or guided) and use_triton(logits):
        # All greedy on raw logits: arg-max and its log-probability in two parallel passes
        # (kernels/triton_sampling.py) instead of torch's two single-block reductions. They
        # read the model's dtype and widen in registers: the float32 copy of a batch of 256
        # rows of 128k logits took ~0.1 ms a step, and widening is exact, so the tokens and
        # log-probabilities are those of the copy.
        token, chosen = greedy_triton(logits)
        return SampleResult(token, chosen, None, None)
    raw = logits.float()
    allowed = None
    if guided:
        # First, before biases, penalties, temperature and the top-k/p filters: to every
        # later rule a token the grammar forbids is one the model gave probability 0, so
        # log-probabilities (the model's own too) are over the allowed tokens only.
        allowed = _allowed(rows, vocab, logits.device)
        raw = raw.masked_fill(~allowed, float("-inf"))
    x = raw
    if penalised or any(sampled):  # an all-greedy batch needs no parameters on the device
        buf, packed = _pack(rows)
        d = _to_device(buf, logits.device)
        head = d[: n * (_FLOATS + _INTS)].view(n, _FLOATS + _INTS)
        fl = head[:, :_FLOATS].to(torch.int32).view(torch.float32)
        greedy, top_k, lo, hi, step, raw_lp = (head[:, _FLOATS + j] for j in range(_INTS))
        keys = _key32(lo, hi, step)
        if packed:
            x = _penalise(x, d, fl, packed)
    if any(sampled):
        ps = [r.params for r, s in zip(rows, sampled) if s]
        f = _filter(x, fl, top_k, any(p.top_k for p in ps),
                    any(p.top_p is not None and p.top_p < 1.0 for p in ps),
                    any(p.typical_p is not None and p.typical_p < 1.0 for p in ps))
        drawn = gumbel_argmax(f, keys)
        is_greedy = greedy.bool()
        dist = torch.where(is_greedy[:, None], x, f)
        token = torch.where(is_greedy, x.argmax(-1), drawn)
    else:
        dist, token = x, x.argmax(-1)
    if dist is not raw:
        # A row left without any finite logit (or with a NaN) samples greedily from the raw ones.
        bad = ~torch.isfinite(dist).any(-1) | torch.isnan(dist).any(-1)
        safe = raw.nan_to_num(nan=-_BIG, posinf=_BIG, neginf=-_BIG)
        dist = torch.where(bad[:, None], safe, dist)
        token = torch.where(bad, safe.argmax(-1), token)
        if any(r.params.raw_logprobs for r in rows):  # the model's own, not those drawn from
            dist = torch.where(raw_lp.bool()[:, None], safe, dist)
    logp = dist.log_softmax(-1)
    if allowed is not None:  # the model's own values above stand in -inf by a finite floor
        logp = logp.masked_fill(~allowed, float("-inf"))
    chosen = logp.gather(1, token[:, None])[:, 0]
    if top_n:
        top_lp, top_ids = logp.topk(min(top_n, vocab), -1)
        return SampleResult(token, chosen, top_ids, top_lp)
    return SampleResult(token, chosen, None, None)
