"""Triton kernel for multi-head latent attention's weight-absorbed decode over the paged latent cache
(GPU path; on CPU it runs under `TRITON_INTERPRET=1` for tests). `paged_attention.latent_decode_attention`
is the reference (the torch path, which gathers the block table's whole width).

`latent_decode_attention(q_lat, q_rope, cache, block_tables, seq_lens, scale)`: one query token per
sequence. Every query head scores the same cached vectors, one "KV head" `kv_lora_rank + qk_rope_head_dim`
wide (`s = q_lat . c + q_rope . k_r`), and takes the probability-weighted latent `c` as its value; the
caller applies W_UK before and W_UV after (latent_attention.py). As triton_paged's decode, split over
the context (flash-decoding): one program per (sequence, tile of 16 query heads, partition of the
context) reads the partition's blocks through the block table once for its 16 heads (the tile is the
tensor-core minimum; vLLM's and SGLang's MLA decode kernels group heads the same way), with an online
softmax in fp32; a second kernel merges the partitions. The launch depends only on shapes (batch, heads,
the table's width), never on the lengths, and nothing is read back to the host: a CUDA graph captures
it. Partitions past a sequence's end return at once; table entries past its blocks are never read.

Layout: the cache of one layer is `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (kv_cache.py's
latent layout), the latent first, then the rotated shared key. The widths need not be powers of two
(masks pad them); on a GPU block_size 16 (the engine's) or a divisor of it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

# HAS_TRITON: callers read it here, as from triton_moe.
from pdserve.engine.kernels.triton_paged import HAS_TRITON, _num_sms, _pow2, decode_partition_blocks  # noqa: F401

_BLOCK_H = 16  # query heads per program: the tensor-core minimum of a product's rows
_TILE_TOKENS = 16  # cached tokens per iteration: a [16, 512] latent tile already fills the registers


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def _partition_kernel(q_lat_ptr, q_rope_ptr, cache_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale,
                          num_heads, stride_lb, stride_lh, stride_rb, stride_rh, stride_cb, stride_cs, stride_tb,
                          RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr,
                          BLOCK_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          PARTITION_BLOCKS: tl.constexpr, TILE_BLOCKS: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)  # int64: offsets into a large cache overflow 32 bits
        heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        part = tl.program_id(2).to(tl.int64)
        num_parts = tl.num_programs(2)
        h_ok = heads < num_heads
        dr = tl.arange(0, BLOCK_RANK)
        dp = tl.arange(0, BLOCK_ROPE)
        r_ok = dr < RANK
        p_ok = dp < ROPE
        t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # a tile's tokens: block t // BLOCK_SIZE of the tile
        seq_len = tl.load(lens_ptr + seq)
        first = part * PARTITION_BLOCKS
        end = tl.minimum(first + PARTITION_BLOCKS, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_RANK], tl.float32)
        if first < end:
            q_lat = tl.load(q_lat_ptr + seq * stride_lb + heads[:, None] * stride_lh + dr[None, :],
                            mask=h_ok[:, None] & r_ok[None, :], other=0.0)
            q_rope = tl.load(q_rope_ptr + seq * stride_rb + heads[:, None] * stride_rh + dp[None, :],
                             mask=h_ok[:, None] & p_ok[None, :], other=0.0)
            for it in range(0, PARTITION_BLOCKS, TILE_BLOCKS):
                b = first + it + t // BLOCK_SIZE
                block = tl.load(tables_ptr + seq * stride_tb + b, mask=b < end, other=0)
                pos = b * BLOCK_SIZE + t % BLOCK_SIZE
                valid = (b < end) & (pos < seq_len)
                row = block * stride_cb + (t % BLOCK_SIZE) * stride_cs
                c = tl.load(cache_ptr + row[:, None] + dr[None, :], mask=valid[:, None] & r_ok[None, :],
                            other=0.0).to(q_lat.dtype)
                k_rope = tl.load(cache_ptr + row[:, None] + RANK + dp[None, :], mask=valid[:, None] & p_ok[None, :],
                                 other=0.0).to(q_lat.dtype)
                # "ieee": fp32 inputs must not drop to TF32 on a GPU (bf16/fp16 are unaffected).
                scores = (tl.dot(q_lat, tl.trans(c), input_precision="ieee").to(tl.float32)
                          + tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee").to(tl.float32)) * scale
                scores = tl.where(valid[None, :], scores, float("-inf"))  # [heads, tile]
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile past the end: nothing seen
                alpha = tl.exp(m - m_safe)
                p = tl.exp(scores - m_safe[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                # The values are the latents themselves.
                acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee").to(tl.float32)
                m = m_new
        # Every partition writes, an empty one (-inf, 0, 0): the merge weighs it by exp(-inf) = 0.
        # Partial rows are (sequence, query head, partition).
        rows = (seq * num_heads + heads) * num_parts + part
        tl.store(m_ptr + rows, m, mask=h_ok)
        tl.store(l_ptr + rows, l, mask=h_ok)
        tl.store(acc_ptr + rows[:, None] * RANK + dr[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, num_parts,
                      RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_P: tl.constexpr):
        # One program per (sequence, head); the partitions' latents summed one at a time (a
        # [partitions, 512] tile would not fit the registers).
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        base = (seq * tl.num_programs(1) + head) * num_parts
        parts = tl.arange(0, BLOCK_P)
        dr = tl.arange(0, BLOCK_RANK)
        r_ok = dr < RANK
        # The first partition always holds a token (lengths are >= 1): the max is finite.
        m_max = tl.max(tl.load(m_ptr + base + parts, mask=parts < num_parts, other=float("-inf")), axis=0)
        num = tl.zeros([BLOCK_RANK], tl.float32)
        den = m_max * 0.0  # a float32 scalar, as the loop carries it
        for i in range(num_parts):
            w = tl.exp(tl.load(m_ptr + base + i) - m_max)
            den += w * tl.load(l_ptr + base + i)
            num += w * tl.load(acc_ptr + (base + i) * RANK + dr, mask=r_ok, other=0.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dr, (num / den).to(out_ptr.dtype.element_ty),
                 mask=r_ok)

    return SimpleNamespace(partition=_partition_kernel, merge=_merge_kernel)


def latent_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            partition_blocks: int | None = None) -> torch.Tensor:
    """q_lat `[batch, heads, kv_lora_rank]` (W_UK folded in), q_rope `[batch, heads, qk_rope_head_dim]`
    (rotated; heads at any stride, a view of the query projection), cache `[num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim]`, block_tables `[batch, max_blocks]`, seq_lens `[batch]` ->
    the probability-weighted latents `[batch, heads, kv_lora_rank]`. `partition_blocks` overrides
    the partition size (tests)."""
    batch, num_heads, rank = q_lat.shape
    rope = q_rope.shape[2]
    _, block_size, latent_dim = cache.shape
    assert latent_dim == rank + rope and cache.stride(2) == 1
    if q_lat.stride(2) != 1:
        q_lat = q_lat.contiguous()
    if q_rope.stride(2) != 1:
        q_rope = q_rope.contiguous()
    head_tiles = -(-num_heads // _BLOCK_H)
    width = block_tables.shape[1]
    partition = partition_blocks or decode_partition_blocks(width, batch * head_tiles, _num_sms(q_lat.device))
    tile_blocks = min(max(1, _TILE_TOKENS // block_size), partition)
    num_parts = -(-width // partition)
    m = torch.empty(batch, num_heads, num_parts, dtype=torch.float32, device=q_lat.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, num_heads, num_parts, rank, dtype=torch.float32, device=q_lat.device)
    out = torch.empty(batch, num_heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    block_rank, block_rope = max(16, _pow2(rank)), max(16, _pow2(rope))  # a product's inner size: >= 16
    k = _kernels()
    k.partition[(batch, head_tiles, num_parts)](
        q_lat, q_rope, cache, block_tables, seq_lens, m, l, acc, scale, num_heads,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), RANK=rank, ROPE=rope, BLOCK_RANK=block_rank, BLOCK_ROPE=block_rope,
        BLOCK_H=_BLOCK_H, BLOCK_SIZE=block_size, PARTITION_BLOCKS=partition, TILE_BLOCKS=tile_blocks)
    k.merge[(batch, num_heads)](m, l, acc, out, out.stride(0), out.stride(1), num_parts, RANK=rank,
                                BLOCK_RANK=block_rank, BLOCK_P=_pow2(num_parts))
    return out
