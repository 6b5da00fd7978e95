"""Paged attention, torch path (CPU, and the reference the Triton kernels are checked against).

Inputs are one layer's cache halves `k_cache`, `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, block tables mapping each sequence's logical
blocks to physical ones, and the queries of the current step. GQA: query head h reads KV head
`h // (num_heads // num_kv_heads)`. The cache may hold a narrower dtype than the queries
(`kv_cache_dtype`): K and V are rounded to it when written, and every attention reads them as the
cache holds them, fresh ones included, so a token's output does not depend on which path ran.

- `write_kv`: scatter this step's K/V into their slots (`slot = block_id * block_size + offset`).
- `paged_decode_attention`: one query token per sequence, any context lengths; gathers the
  sequences' blocks into a reusable workspace (fresh large allocations cost page faults on CPU).
- `paged_prefill_attention`: a chunk of queries per sequence attending to a cached prefix plus
  itself, causal.
- `latent_decode_attention`: multi-head latent attention's weight-absorbed decode over one layer's
  latent cache `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (latent_attention.py):
  every query head against the cached vectors as one key head, the latents as values.

With a `window` W (a sliding-window layer, Gemma 3's), the query at position p attends only the
keys at positions p - W + 1 .. p (transformers' `kv_idx > q_idx - sliding_window`); the blocks
wholly before that may be any valid block id (a sliding layer's table gives back blocks that fall
out of its window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatherWorkspace:
    """Reusable buffers for gathered K/V; grows to the largest batch seen."""

    def __init__(self):
        self._k = torch.empty(0)
        self._v = torch.empty(0)

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, *like.shape[1:])
        numel = like[0].numel() * num_blocks
        if self._k.numel() < numel or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: `[num_tokens, num_kv_heads, head_dim]`; slot_mapping: `[num_tokens]` int64."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           workspace: GatherWorkspace | None = None,
                           mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q: `[batch, num_heads, head_dim]`; block_tables: `[batch, max_blocks]` (padding entries may
    be any valid block id); seq_lens: `[batch]`. `mask` (`decode_mask(seq_lens, max_blocks *
    block_size)`) may be passed in so a step builds it once for all layers.
    Returns `[batch, num_heads, head_dim]`."""
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = max_blocks * block_size
    idx = block_tables.reshape(-1)
    if workspace is None:
        k = k_cache.index_select(0, idx)
        v = v_cache.index_select(0, idx)
    else:
        k, v = workspace.get(idx.numel(), k_cache)
        torch.index_select(k_cache, 0, idx, out=k)
        torch.index_select(v_cache, 0, idx, out=v)
    k = k.view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    v = v.view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    if mask is None:
        mask = decode_mask(seq_lens, max_len, q.dtype, window)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def latent_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat `[batch, heads, kv_lora_rank]`, q_rope `[batch, heads, qk_rope_head_dim]`, block_tables
    `[batch, max_blocks]` (padding entries may be any valid block id), seq_lens `[batch]` -> the
    probability-weighted latents `[batch, heads, kv_lora_rank]`. It reads the table's whole width
    (`max_blocks * block_size` vectors a sequence, masked by `mask`, `decode_mask(seq_lens, ...)`)."""
    rank = q_lat.shape[2]
    batch, width = block_tables.shape
    block_size, dim = cache.shape[1:]
    query = torch.cat((q_lat, q_rope), dim=-1).unsqueeze(2)  # [batch, heads, 1, rank + rope]
    ctx = cache.index_select(0, block_tables.reshape(-1)).view(batch, 1, width * block_size, dim).to(q_lat.dtype)
    if mask is None:
        mask = decode_mask(seq_lens, width * block_size, q_lat.dtype)
    # One key "head" (the cached vectors) for every query head; the values are the latents.
    out = F.scaled_dot_product_attention(query, ctx, ctx[..., :rank], attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def window_decode_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int,
                         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A sliding-window layer's decode inputs: each sequence's block table cut to the blocks its
    window reaches (`[batch, cdiv(window - 1, block_size) + 1]` at most, so a decode step reads
    the window, not the whole sequence), and the `[batch, 1, 1, blocks * block_size]` mask over them."""
    width = block_tables.shape[1]
    num = min(width, -(-(window - 1) // block_size) + 1)
    start = ((seq_lens - window).clamp(min=0) // block_size).clamp(max=width - num)
    index = start[:, None] + torch.arange(num, device=seq_lens.device)[None, :]
    pos = start[:, None] * block_size + torch.arange(num * block_size, device=seq_lens.device)[None, :]
    outside = (pos >= seq_lens[:, None]) | (pos < seq_lens[:, None] - window)
    mask = torch.zeros(outside.shape, dtype=dtype, device=seq_lens.device).masked_fill_(outside, float("-inf"))
    return block_tables.gather(1, index), mask[:, None, None, :]


def decode_mask(seq_lens: torch.Tensor, max_len: int, dtype: torch.dtype = torch.float32,
                window: int | None = None) -> torch.Tensor:
    """`[batch, 1, 1, max_len]` additive mask: 0 inside each sequence (its last `window` positions
    with one), -inf elsewhere. Additive in the query dtype, because SDPA converts a boolean mask to
    that on every call."""
    pos = torch.arange(max_len, device=seq_lens.device)[None, :]
    outside = pos >= seq_lens[:, None]
    if window is not None:
        outside |= pos < seq_lens[:, None] - window
    mask = torch.zeros(outside.shape, dtype=dtype, device=seq_lens.device).masked_fill_(outside, float("-inf"))
    return mask[:, None, None, :]


def paged_prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                            context_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """One sequence's chunk: q `[q_len, num_heads, head_dim]`, its fresh K/V `[q_len, kv_heads,
    head_dim]` (already written to the cache), `context_len` = cached prefix + q_len. Returns
    `[q_len, num_heads, head_dim]`."""
    q_len = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)
    if context_len == q_len and (window is None or q_len <= window):
        # Nothing cached before this chunk: attend to the fresh K/V (as the cache holds them), no gather.
        k = k_new.to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        v = v_new.to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_blocks = -(-context_len // block_size)
    # With a window, the blocks before the first query's window are not read (nor held, perhaps).
    first = 0 if window is None else max(0, (context_len - q_len - window + 1) // block_size)
    blocks = block_table[first:num_blocks]
    start = first * block_size
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len - start].to(q.dtype)
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len - start].to(q.dtype)
    # Query i sits at absolute position context_len - q_len + i and sees keys up to there.
    q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
    k_pos = torch.arange(start, context_len, device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(qt, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
