"""Sliding-window paged attention on every kernel `ops` may choose (the torch path, the C kernels,
the Triton kernels under the interpreter on CPU) against dense attention with transformers' window
mask (`kv_idx > q_idx - window`: a query sees its last W positions, itself included). The blocks
wholly before each window are given back in the table (entry 0, which holds garbage), as a
sliding layer group's table leaves them: a kernel that read them would not match."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton's mode is chosen when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.kernels import cpu_kernels, triton_paged  # noqa: E402
from pdserve.engine.kernels.paged_attention import (paged_decode_attention, paged_prefill_attention,  # noqa: E402
                                                    window_decode_tables, write_kv)

HEADS, KV_HEADS = 4, 2
KERNELS = ["torch", "c"] + (["triton"] if triton_paged.HAS_TRITON else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dense(q, k, v, q_pos, window, scale):
    """q `[n, heads, dim]` at positions q_pos over keys 0..len(k)-1."""
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _cache(lengths, block_size, dim, first_needed, num_blocks=64):
    """Caches holding each sequence's K/V in blocks of its own (block 0: garbage), and tables whose
    entries before `first_needed(length)` are given back (0)."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, dim, generator=g) * 50  # garbage that would show
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, dim, generator=g) * 50
    keys, tables, next_block = [], [], 1
    for n in lengths:
        k = torch.randn(n, KV_HEADS, dim, generator=g)
        v = torch.randn(n, KV_HEADS, dim, generator=g)
        table = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(table)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(k, v, k_cache, v_cache, slots)
        first = first_needed(n)
        tables.append([0] * first + table[first:])
        keys.append((k, v))
    return k_cache, v_cache, keys, tables


def _decode(kernel, q, k_cache, v_cache, tables, lens, scale, window):
    block_size = k_cache.shape[1]
    if kernel == "torch":
        cut, mask = window_decode_tables(tables, lens, block_size, window)
        assert cut.shape[1] <= -(-(window - 1) // block_size) + 1  # only the blocks a window reaches
        return paged_decode_attention(q, k_cache, v_cache, cut, lens, scale, mask=mask)
    if kernel == "c":
        return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return triton_paged.paged_decode_attention(on(q), on(k_cache), on(v_cache), on(tables), on(lens), scale,
                                               window=window).cpu()


# (block size, head dim, window): windows under a block, of one block, over one and over several;
# head dims the C kernel's 512-bit loops take (16, 64) and one they leave to the 256-bit ones (24).
SHAPES = [(16, 16, 5), (16, 16, 16), (16, 16, 23), (16, 64, 40), (4, 16, 10), (8, 24, 13)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size,dim,window", SHAPES)
def test_decode_sees_only_its_window(kernel, block_size, dim, window):
    if kernel == "triton" and dim & (dim - 1):
        pytest.skip("Triton's kernels take power-of-two head dims")
    if kernel == "c" and not cpu_kernels.usable(torch.zeros(1)):
        pytest.skip("no C kernels on this machine")
    # Shorter than the window, exactly it, one past it, ends on and inside blocks, long.
    lengths = [1, window - 1, window, window + 1, 2 * block_size, 3 * block_size + 1, 97]
    lengths = [n for n in lengths if n > 0]
    k_cache, v_cache, keys, tables = _cache(lengths, block_size, dim,
                                            lambda n: max(0, (n - window) // block_size))
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), HEADS, dim)
    scale = dim ** -0.5
    out = _decode(kernel, q, k_cache, v_cache, padded, lens, scale, window)
    for i, n in enumerate(lengths):
        k, v = keys[i]
        want = _dense(q[i:i + 1], k, v, torch.tensor([n - 1]), window, scale)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=2e-5)


def _prefill(kernel, q, k_new, v_new, k_cache, v_cache, table, context_len, scale, window):
    if kernel == "torch":
        return paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, table, context_len, scale, window)
    if kernel == "c":
        return cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, context_len, scale, window=window)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    cu = torch.tensor([0, q.shape[0]])
    # 16-query tiles: a chunk's tiles start their windows at different blocks
    return triton_paged.paged_prefill_attention(on(q), on(k_cache), on(v_cache), on(cu), on(torch.tensor([context_len])),
                                                on(table[None, :]), scale, block_m=16, window=window).cpu()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size,dim,window", SHAPES)
def test_prefill_chunks_see_only_their_windows(kernel, block_size, dim, window):
    if kernel == "triton" and dim & (dim - 1):
        pytest.skip("Triton's kernels take power-of-two head dims")
    n = 90
    k_cache, v_cache, [(k, v)], _ = _cache([n], block_size, dim, lambda n: 0)
    q = torch.randn(n, HEADS, dim)
    scale = dim ** -0.5
    full = list(range(1, 1 + -(-n // block_size)))
    # (cached prefix, end): the whole prompt (query blocks of the C kernel start their windows at
    # different panels); chunks after a prefix longer than the window; a chunk inside it; one token.
    for start, end in ((0, n), (0, 12), (20, 67), (window + 3, n), (30, 33), (n - 1, n)):
        first = max(0, (start - window + 1) // block_size)  # the blocks the group gave back before the chunk
        table = torch.tensor([0] * first + full[first:])
        got = _prefill(kernel, q[start:end], k[start:end], v[start:end], k_cache, v_cache, table, end, scale, window)
        want = _dense(q[start:end], k[:end], v[:end], torch.arange(start, end), window, scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"chunk {start}:{end}: {m}")
