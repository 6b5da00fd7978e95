"""Sliding-window attention on the torch paged path (kernels/paged_attention.py) against dense
attention with transformers' window mask (`kv_idx > q_idx - window`), with the blocks before
each window replaced by garbage, as a sliding layer group's table leaves them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.kernels.paged_attention import (paged_decode_attention, paged_prefill_attention,
                                                    window_decode_tables, write_kv)

BS, HEADS, KV_HEADS, DIM, WINDOW = 4, 4, 2, 8, 10


def _dense(q, k, v, q_pos, window):
    """q `[n, heads, dim]` at positions q_pos over keys 0..len(k)-1."""
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=DIM ** -0.5, enable_gqa=True)
    return out.transpose(0, 1)


def _cache(lengths, num_blocks=64):
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM, generator=g)
    keys, tables, next_block = [], [], 1
    for n in lengths:
        k = torch.randn(n, KV_HEADS, DIM, generator=g)
        v = torch.randn(n, KV_HEADS, DIM, generator=g)
        table = list(range(next_block, next_block + -(-n // BS)))
        next_block += len(table)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        write_kv(k, v, k_cache, v_cache, slots)
        first = max(0, (n - WINDOW) // BS)  # blocks before the window: given back, entry 0, garbage
        tables.append([0] * first + table[first:])
        keys.append((k, v))
    return k_cache, v_cache, keys, tables


def test_decode_reads_only_the_window():
    lengths = [3, 10, 11, 23, 37]
    k_cache, v_cache, keys, tables = _cache(lengths)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(lengths)
    cut, mask = window_decode_tables(padded, lens, BS, WINDOW)
    assert cut.shape[1] == -(-(WINDOW - 1) // BS) + 1
    q = torch.randn(len(lengths), HEADS, DIM)
    out = paged_decode_attention(q, k_cache, v_cache, cut, lens, DIM ** -0.5, mask=mask)
    for i, n in enumerate(lengths):
        k, v = keys[i]
        want = _dense(q[i:i + 1], k, v, torch.tensor([n - 1]), WINDOW)
        torch.testing.assert_close(out[i:i + 1], want)


def test_prefill_chunks_read_only_their_windows():
    n = 37
    k_cache, v_cache, [(k, v)], [table] = _cache([n])
    q = torch.randn(n, HEADS, DIM)
    for start, end in ((0, 37), (0, 12), (20, 37), (30, 33)):
        first = max(0, (start - WINDOW + 1) // BS)
        full = list(range(1, 1 + -(-n // BS)))
        chunk_table = torch.tensor([0] * first + full[first:])  # earlier blocks given back
        got = paged_prefill_attention(q[start:end], k[start:end], v[start:end], k_cache, v_cache, chunk_table, end,
                                      DIM ** -0.5, WINDOW)
        want = _dense(q[start:end], k[:end], v[:end], torch.arange(start, end), WINDOW)
        torch.testing.assert_close(got, want)
