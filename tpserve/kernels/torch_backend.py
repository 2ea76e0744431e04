"""The portable reference backend: plain PyTorch ops, so it runs on CPU, CUDA and XPU alike.

Decode is one vectorised gather over the block tables for the whole batch. Prefill goes
sequence by sequence (bounded memory: scores are [heads, q_len, context] for one sequence)
and batches any decode rows of a mixed step together. Dense (encoder) attention goes
sequence by sequence too. Every base.py feature is supported (attention sinks and chunked
attention in paged attention; dense attention has no use for them yet), so this is the
reference.
An fp8 cache is read back to the query's dtype and scaled right after the gather
(kv_quant.dequantize), so the arithmetic after it is the full-precision path's.
"""

from __future__ import annotations

import torch

from tpserve.kernels import kv_quant
from tpserve.kernels.base import AttentionBackend, AttentionMetadata, AttentionSpec, RelBias


def attend_padded(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    q_pos: torch.Tensor,  # [B, Q] absolute positions of the queries
    ctx_len: torch.Tensor,  # [B] valid keys per sequence (positions 0..ctx_len-1)
    spec: AttentionSpec,
    alibi_slopes: torch.Tensor | None,
    rel_bias: RelBias | None = None,  # [Hq, 2R + 1], see kernels/base.py
    k_start: torch.Tensor | None = None,  # [B] position of k[:, 0] (default 0)
    sinks: torch.Tensor | None = None,  # [Hq] logits that join the denominator (base.py)
) -> torch.Tensor:
    """Attention of padded queries over padded keys (causal unless spec.causal is False);
    returns [B, Q, Hq, D]."""
    b, nq, hq, d = q.shape
    hkv, length = k.shape[2], k.shape[1]
    g = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    # Query head h uses KV head h // g, as transformers' repeat_kv does.
    qh = q.to(acc).view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    kh = k.to(acc).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    vh = v.to(acc).permute(0, 2, 1, 3)
    scores = torch.matmul(qh, kh.unsqueeze(2).transpose(-1, -2)) * spec.scale  # [B,Hkv,G,Q,L]
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    k_pos = torch.arange(length, device=q.device).view(1, 1, length)
    if k_start is not None:
        k_pos = k_pos + k_start.view(b, 1, 1)  # [B, 1, L]
    rel = k_pos - q_pos.unsqueeze(-1)  # [B, Q, L], <= 0 where visible
    if alibi_slopes is not None:
        # A per-row shift leaves softmax unchanged, so slope * (k - q) equals the
        # slope * k form of the original ALiBi.
        slopes = alibi_slopes.to(acc).view(1, hkv, g, 1, 1)
        scores = scores + slopes * rel.to(acc).unsqueeze(1).unsqueeze(1)
    if rel_bias is not None:
        r = (rel_bias.shape[1] - 1) // 2
        bias = rel_bias.to(acc)[:, rel.clamp(-r, r) + r]  # [Hq, B, Q, L]
        scores = scores + bias.transpose(0, 1).reshape(b, hkv, g, nq, length)
    visible = k_pos < ctx_len.view(b, 1, 1)  # [B, 1, L]
    if spec.causal:
        visible = visible & (rel <= 0)  # [B, Q, L]
    if spec.sliding_window:
        visible = visible & (rel > -spec.sliding_window)
    if spec.attention_chunk:
        c = spec.attention_chunk
        visible = visible & (k_pos // c == q_pos.unsqueeze(-1) // c)
    scores = scores.masked_fill(~visible.unsqueeze(1).unsqueeze(1), float("-inf"))
    if sinks is not None:
        # The sink is one more column of the softmax whose value is never read.
        sink = sinks.to(acc).view(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded rows see nothing
    out = torch.matmul(probs, vh.unsqueeze(2))  # [B, Hkv, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d).to(q.dtype)


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[num_blocks, block, H, D] cache + [B, nb] tables -> [B, nb * block, H, D] (nb trimmed).
    An fp8 cache comes back dequantized to `dtype` (stored * scale)."""
    block = cache.shape[1]
    nb = -(-max_len // block)
    out = cache[block_tables[:, :nb].long()].flatten(1, 2)
    return kv_quant.dequantize(out, scale, dtype) if kv_quant.is_fp8(cache) else out


def _visible_span(seq_lens: torch.Tensor, spec: AttentionSpec
                  ) -> tuple[torch.Tensor, int] | None:
    """For a decode row at position seq_len - 1: the first position it may see ([B]) and
    how many positions from there at most; None when it may see the whole context."""
    if not spec.causal:
        return None
    if spec.sliding_window:
        return (seq_lens - spec.sliding_window).clamp(min=0), spec.sliding_window
    if spec.attention_chunk:
        c = spec.attention_chunk
        return (seq_lens - 1) // c * c, c
    return None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    fp8_kv_cache = True

    @classmethod
    def supports(cls, device, dtype, spec) -> str | None:
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        if spec.kv_cache_dtype == "fp8":
            return kv_quant.fp8_unavailable(torch.device(device))
        if spec.sinks and not spec.paged:
            return "attention sinks in dense (encoder) attention are not implemented"
        if spec.attention_chunk and not spec.paged:
            return "chunked attention in dense (encoder) attention is not implemented"
        return None

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, rel_bias=None,
               sinks=None):
        seq_lens = meta.seq_lens.long()
        tables, length, k_start = meta.block_tables, meta.max_seq_len, None
        block = k_cache.shape[1]
        seen = _visible_span(seq_lens, spec)
        if seen is not None:
            # Only the blocks holding the last `extent` positions can be seen: gather those
            # rather than the whole context, so a windowed (or chunked) step costs O(extent).
            start, extent = seen
            span = -(-extent // block) + 1
            if span < -(-length // block):
                first = start // block  # [B]
                idx = first[:, None] + torch.arange(span, device=q.device)[None]
                # Past the table's end the positions are >= seq_len, so they are masked.
                tables = tables.gather(1, idx.clamp(max=tables.shape[1] - 1))
                length, k_start = span * block, first * block
        k = gather_context(k_cache, tables, length, spec.k_scale, q.dtype)
        v = gather_context(v_cache, tables, length, spec.v_scale, q.dtype)
        out = attend_padded(q.unsqueeze(1), k, v, (seq_lens - 1).unsqueeze(1), seq_lens,
                            spec, alibi_slopes, rel_bias, k_start, sinks)
        return out.squeeze(1)

    def prefill(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None, rel_bias=None,
                sinks=None):
        q_lens = meta.query_lens_host or tuple(
            (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist())
        seq_lens = meta.seq_lens_host or tuple(meta.seq_lens.tolist())
        out = torch.empty_like(q)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
        if decode_rows:
            idx = torch.tensor(decode_rows, device=q.device)
            tok = torch.tensor([starts[i] for i in decode_rows], device=q.device)
            sub = AttentionMetadata(
                query_start_loc=meta.query_start_loc[: len(decode_rows) + 1],
                seq_lens=meta.seq_lens[idx], block_tables=meta.block_tables[idx],
                slot_mapping=meta.slot_mapping, max_query_len=1,
                max_seq_len=max(seq_lens[i] for i in decode_rows))
            out[tok] = self.decode(q[tok], k_cache, v_cache, sub, spec, alibi_slopes, rel_bias,
                                   sinks)
        short = [i for i, n in enumerate(q_lens) if 1 < n <= _SHORT_ROW]
        for rows in _budgeted(short, q_lens, seq_lens, q.shape[1]):
            self._short_rows(q, k_cache, v_cache, meta, spec, alibi_slopes, rel_bias, out,
                             rows, starts, q_lens, seq_lens, sinks)
        for i, n in enumerate(q_lens):
            if n <= _SHORT_ROW:
                continue
            s, ctx = starts[i], seq_lens[i]
            k = gather_context(k_cache, meta.block_tables[i : i + 1], ctx, spec.k_scale, q.dtype)
            v = gather_context(v_cache, meta.block_tables[i : i + 1], ctx, spec.v_scale, q.dtype)
            q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(0)
            ctx_t = torch.tensor([ctx], device=q.device)
            out[s : s + n] = attend_padded(q[s : s + n].unsqueeze(0), k, v, q_pos, ctx_t, spec,
                                           alibi_slopes, rel_bias, sinks=sinks)[0]
        return out

    def attend_dense(self, q, k, v, meta, spec, rel_bias=None):
        lens = meta.query_lens_host or tuple(
            (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist())
        out = torch.empty_like(q)
        s = 0
        for n in lens:
            pos = torch.arange(n, device=q.device).unsqueeze(0)
            ctx_t = torch.tensor([n], device=q.device)
            out[s : s + n] = attend_padded(q[None, s : s + n], k[None, s : s + n],
                                           v[None, s : s + n], pos, ctx_t, spec, None,
                                           rel_bias)[0]
            s += n
        return out

    def _short_rows(self, q, k_cache, v_cache, meta, spec, alibi_slopes, rel_bias, out, rows,
                    starts, q_lens, seq_lens, sinks=None) -> None:
        """Rows of a few tokens (speculative verification, small prompt chunks) in one
        padded call, as decode batches its rows: queries padded to the longest row by
        repeating each row's last one, whose outputs are dropped."""
        width = max(q_lens[i] for i in rows)
        pad = [[min(j, q_lens[i] - 1) for j in range(width)] for i in rows]
        dev = q.device
        tok = torch.tensor([[starts[i] + j for j in js] for i, js in zip(rows, pad, strict=True)],
                           device=dev)
        q_pos = torch.tensor([[seq_lens[i] - q_lens[i] + j for j in js]
                              for i, js in zip(rows, pad, strict=True)], device=dev)
        ctx = torch.tensor([seq_lens[i] for i in rows], device=dev)
        tables = meta.block_tables[torch.tensor(rows, device=dev)]
        longest = max(seq_lens[i] for i in rows)
        k = gather_context(k_cache, tables, longest, spec.k_scale, q.dtype)
        v = gather_context(v_cache, tables, longest, spec.v_scale, q.dtype)
        res = attend_padded(q[tok], k, v, q_pos, ctx, spec, alibi_slopes, rel_bias,
                            sinks=sinks)
        b_idx = torch.tensor([b for b, i in enumerate(rows) for _ in range(q_lens[i])],
                             device=dev)
        j_idx = torch.tensor([j for i in rows for j in range(q_lens[i])], device=dev)
        dst = torch.tensor([starts[i] + j for i in rows for j in range(q_lens[i])], device=dev)
        out[dst] = res[b_idx, j_idx]


# Rows of at most this many tokens are attended together in one padded call; longer ones
# one by one (their scores alone are [heads, q_len, context]).
_SHORT_ROW = 32
# Most score elements (rows x padded queries x context x query heads) of one padded call.
_SHORT_BUDGET = 1 << 24


def _budgeted(rows: list[int], q_lens, seq_lens, heads: int) -> list[list[int]]:
    """rows split into groups whose padded scores stay within _SHORT_BUDGET elements."""
    groups: list[list[int]] = []
    cur: list[int] = []
    width = ctx = 0
    for i in rows:
        w, c = max(width, q_lens[i]), max(ctx, seq_lens[i])
        if cur and (len(cur) + 1) * w * c * heads > _SHORT_BUDGET:
            groups.append(cur)
            cur, w, c = [], q_lens[i], seq_lens[i]
        cur.append(i)
        width, ctx = w, c
    if cur:
        groups.append(cur)
    return groups
