"""Triton kernels for the paged KV cache (GPU path; on CPU they run under `TRITON_INTERPRET=1` for
tests). Same semantics and layouts as the torch path in `paged_attention.py` and
`kvtransfer/blocks.py`, which stay the reference:

- `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)`: one query token
  per sequence, split over the context as flash-decoding does: one program per (sequence, KV
  head, partition of the context) serves that head's group of query heads (GQA), reading
  `_TILE_BLOCKS` blocks per iteration through the block table (several loads in flight, one
  tensor-core product per tile: the group is padded to 16 rows) with an online softmax in fp32;
  a second kernel merges the partitions. The partition count follows the block table's width,
  not the batch's longest sequence, so the launch is the same every step (CUDA graphs) and no
  device sync is needed; partitions past a sequence's end return at once. With a sliding `window`
  W (the query sees keys at positions > len - 1 - W), the partitions cover the blocks from the
  window's first one on: at most `cdiv(W - 1, block_size) + 1` of them, a shape still.
- `paged_prefill_attention(q, k_cache, v_cache, cu_query_lens, context_lens, block_tables, scale)`:
  a varlen batch of prefill chunks in one launch; each chunk attends causally to its cached prefix
  and itself (its K/V already written). One program per (sequence, query head, 64 queries), keys
  `_TILE_BLOCKS` blocks at a time (64 x 64 tensor-core tiles with 16-token blocks); with a `window`,
  from the block of its first query's first visible key on.
  Under a window, table entries before the blocks read may be anything (a sliding layer's table
  holds placeholders there).
- `write_kv(k, v, k_cache, v_cache, slot_mapping)`: a step's new K and V into their cache slots,
  one launch for both.
- `gather_blocks(kv, block_ids, heads)` / `scatter_blocks(kv, block_ids, data)`: a request's blocks
  of the whole cache `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` to and from one
  contiguous buffer (an optional KV-head slice), for the KV transfer; `copy_blocks` from another
  cache (mapped over CUDA IPC) straight into this one. One kernel does all three.

Cache halves per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`; query head h reads
KV head h // (num_heads // num_kv_heads). head_dim and block_size must be powers of two (the
engine's 16-token blocks are); prefill on a GPU also needs them >= 16 (tensor-core tiles).
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

from pdserve.engine.host_tensors import long_tensor

# Triton is imported on first use, not with the engine: the CPU engine runs without it, and the
# interpreter (TRITON_INTERPRET=1) must be chosen before the kernels are defined.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_partition_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale,
                                 stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb,
                                 GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, PARTITION_BLOCKS: tl.constexpr,
                                 TILE_BLOCKS: tl.constexpr, WINDOW: tl.constexpr):
        # int64 program ids: offsets into a large cache overflow 32 bits.
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2).to(tl.int64)
        num_parts = tl.num_programs(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # a tile's tokens: block t // BLOCK_SIZE of the tile
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        seq_len = tl.load(lens_ptr + seq)
        first = part * PARTITION_BLOCKS
        lowest = seq_len * 0  # the first visible position
        if WINDOW > 0:  # partitions start at the window's first block
            lowest = tl.maximum(seq_len - WINDOW, 0)
            first += lowest // BLOCK_SIZE
        # This partition's blocks. (No tl.cdiv: a Triton imported before TRITON_INTERPRET was set
        # cannot run its library's jit functions in the interpreter.)
        end = tl.minimum(first + PARTITION_BLOCKS, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        if first < end:
            q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None],
                        other=0.0)
            for it in range(0, PARTITION_BLOCKS, TILE_BLOCKS):
                b = first + it + t // BLOCK_SIZE
                block = tl.load(tables_ptr + seq * stride_tb + b, mask=b < end, other=0)
                pos = b * BLOCK_SIZE + t % BLOCK_SIZE
                valid = (b < end) & (pos < seq_len) & (pos >= lowest)
                offs = block[:, None] * stride_cb + (t % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch \
                    + d[None, :]
                k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
                v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
                # "ieee": fp32 inputs must not drop to TF32 on a GPU (bf16/fp16 are unaffected).
                scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale  # [G, tile]
                scores = tl.where(valid[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile past the end: nothing seen
                alpha = tl.exp(m - m_safe)
                p = tl.exp(scores - m_safe[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
                m = m_new
        # Every partition writes, an empty one (-inf, 0, 0): the merge weighs it by exp(-inf) = 0.
        # Partial rows are (sequence, query head, partition).
        row = (seq * tl.num_programs(1) * GROUP + heads) * num_parts + part
        tl.store(m_ptr + row, m, mask=g_ok)
        tl.store(l_ptr + row, l, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, num_parts,
                             BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        parts = tl.arange(0, BLOCK_P)
        d = tl.arange(0, HEAD_DIM)
        p_ok = parts < num_parts
        rows = (seq * tl.num_programs(1) + head) * num_parts + parts
        m = tl.load(m_ptr + rows, mask=p_ok, other=float("-inf"))
        l = tl.load(l_ptr + rows, mask=p_ok, other=0.0)
        acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=p_ok[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))  # the first partition always holds a token: the max is finite
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, cu_ptr, ctx_ptr, out_ptr, scale,
                        stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, TILE_BLOCKS: tl.constexpr, WINDOW: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        # A tile past this chunk's end has every row masked: it loads and stores nothing.
        context_len = tl.load(ctx_ptr + seq)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_ok = rows < q_len
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # a tile's keys: block t // BLOCK_SIZE of the tile
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rows_ok[:, None], other=0.0)
        pos = context_len - q_len + rows  # absolute positions of these queries
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        last = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)  # causal: no key past it
        num_blocks = (last + BLOCK_SIZE - 1) // BLOCK_SIZE
        first_block = num_blocks * 0
        if WINDOW > 0:  # from the block of the tile's first query's first visible key
            first_block = tl.maximum(context_len - q_len + tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_SIZE
        for tile_start in range(first_block, num_blocks, TILE_BLOCKS):
            b = tile_start + t // BLOCK_SIZE
            block = tl.load(tables_ptr + seq * stride_tb + b, mask=b < num_blocks, other=0)
            keys = b * BLOCK_SIZE + t % BLOCK_SIZE
            offs = block[:, None] * stride_cb + (t % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch \
                + d[None, :]
            k = tl.load(k_ptr + offs, mask=(keys < context_len)[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + offs, mask=(keys < context_len)[:, None], other=0.0).to(q.dtype)
            # "ieee": fp32 inputs must not drop to TF32 on a GPU (bf16/fp16 are unaffected).
            scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
            visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < context_len)
            if WINDOW > 0:
                visible &= keys[None, :] > pos[:, None] - WINDOW
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])

    @triton.jit
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_first_head, dst_first_head,
                            src_stride_half, src_stride_block, src_stride_pos, src_stride_head,
                            dst_stride_half, dst_stride_block, dst_stride_pos, dst_stride_head,
                            HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            CHUNK: tl.constexpr, DENSE: tl.constexpr):
        half = tl.program_id(0).to(tl.int64)  # layer * 2 + (0: K, 1: V)
        i = tl.program_id(1).to(tl.int64)  # the i-th block of the request
        src_block = tl.load(src_ids_ptr + i)
        dst_block = tl.load(dst_ids_ptr + i)
        per_block = BLOCK_SIZE * HEADS * HEAD_DIM
        if DENSE:  # whole blocks, dense on both sides: one contiguous span each, copied in wide loads
            src_base = src_ptr + half * src_stride_half + src_block * src_stride_block
            dst_base = dst_ptr + half * dst_stride_half + dst_block * dst_stride_block
            for start in range(0, per_block, CHUNK):
                e = start + tl.arange(0, CHUNK)
                ok = e < per_block
                tl.store(dst_base + e, tl.load(src_base + e, mask=ok), mask=ok)
            return
        for start in range(0, per_block, CHUNK):
            e = start + tl.arange(0, CHUNK)
            ok = e < per_block
            pos = e // (HEADS * HEAD_DIM)
            head = (e // HEAD_DIM) % HEADS
            dim = e % HEAD_DIM
            src = (half * src_stride_half + src_block * src_stride_block + pos * src_stride_pos
                   + (src_first_head + head) * src_stride_head + dim)
            dst = (half * dst_stride_half + dst_block * dst_stride_block + pos * dst_stride_pos
                   + (dst_first_head + head) * dst_stride_head + dim)
            tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=ok), mask=ok)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt,
                         stride_vh, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        ok = (h < HEADS)[:, None]
        cache = slot * HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]  # the cache's slots are dense
        k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
        v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
        tl.store(k_cache_ptr + cache, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + cache, v.to(v_cache_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(decode_partition=_decode_partition_kernel, decode_merge=_decode_merge_kernel,
                           prefill=_prefill_kernel, copy_blocks=_copy_blocks_kernel, write_kv=_write_kv_kernel)


# Decode: blocks read per iteration (several loads in flight), and at most this many partitions of
# the context (each a program per sequence and KV head; those past a sequence's end return at once).
_TILE_BLOCKS = 4
_MAX_PARTITIONS = 64
_PARTITION_BLOCKS = 32  # 512 tokens of 16: longer partitions gained nothing at batch 64 on an H100
_PROGRAMS_PER_SM = 2


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_partition_blocks(max_blocks_per_seq: int, seq_heads: int = 1 << 30, num_sms: int = 1) -> int:
    """Blocks per partition for a block table `max_blocks_per_seq` wide, for `seq_heads` (sequence,
    KV head) pairs on `num_sms` SMs: `_PARTITION_BLOCKS`, or fewer (at least a tile) where the
    launch would otherwise have under `_PROGRAMS_PER_SM` programs an SM (small batches: a batch-1
    step of an 8B model had 8 programs, 13 us a layer), and never more than `_MAX_PARTITIONS`
    partitions. A function of shapes only: each CUDA graph's batch keeps its own."""
    wanted = max_blocks_per_seq * seq_heads // (_PROGRAMS_PER_SM * num_sms)
    blocks = min(_PARTITION_BLOCKS, max(_TILE_BLOCKS, 1 << max(0, wanted.bit_length() - 1)))
    return max(blocks, _pow2(-(-max_blocks_per_seq // _MAX_PARTITIONS)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           partition_blocks: int | None = None, window: int | None = None) -> torch.Tensor:
    """q `[batch, num_heads, head_dim]` -> `[batch, num_heads, head_dim]` (see the module docstring).
    `partition_blocks` overrides the partition size (tests)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]  # the blocks one sequence may read
    if window:
        width = min(width, -(-(window - 1) // block_size) + 1)
    partition = partition_blocks or decode_partition_blocks(width, batch * num_kv_heads, _num_sms(q.device))
    num_parts = -(-width // partition)
    # Each partition's running max, sum and weighted values per (sequence, query head), merged below.
    m = torch.empty(batch, num_heads, num_parts, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.stride(2) != 1:  # heads at any stride (a view of the qkv projection): read in place
        q = q.contiguous()
    k = _kernels()
    k.decode_partition[(batch, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, m, l, acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, _pow2(group)), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        PARTITION_BLOCKS=partition, TILE_BLOCKS=min(_TILE_BLOCKS, partition), WINDOW=window or 0)
    k.decode_merge[(batch, num_heads)](m, l, acc, out, out.stride(0), out.stride(1), num_parts,
                                       BLOCK_P=_pow2(num_parts), HEAD_DIM=head_dim)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """As `paged_attention.write_kv` (k, v `[tokens, kv_heads, head_dim]`, heads at any stride),
    K and V in one launch."""
    tokens, heads, head_dim = k.shape
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if tokens:
        _kernels().write_kv[(tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                                       v.stride(0), v.stride(1), HEADS=heads, HEAD_DIM=head_dim,
                                       BLOCK_H=_pow2(heads))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, block_m: int = 64, max_query_len: int | None = None,
                            window: int | None = None) -> torch.Tensor:
    """q `[total_query_tokens, num_heads, head_dim]` -> same shape (see the module docstring).
    `max_query_len`, when the caller knows it, spares a device sync."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = context_lens.numel()
    max_q = max_query_len or int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    out = torch.empty_like(q)
    q = q.contiguous()
    _kernels().prefill[(batch, num_heads, -(-max_q // block_m))](
        q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        TILE_BLOCKS=_TILE_BLOCKS, WINDOW=window or 0)
    return out


def _copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, src_heads: tuple[int, int],
                 dst: torch.Tensor, dst_ids: torch.Tensor, dst_first_head: int) -> None:
    """Blocks `src_ids` of `src` (heads `src_heads`) into blocks `dst_ids` of `dst` (from head
    `dst_first_head`); both `[layers, 2, blocks, block_size, heads, head_dim]`, last dim contiguous."""
    layers, two, _, block_size, _, head_dim = src.shape
    assert src.stride(5) == 1 and dst.stride(5) == 1 and src.stride(0) == two * src.stride(1) \
        and dst.stride(0) == two * dst.stride(1)
    h0, h1 = src_heads
    heads = h1 - h0

    def dense(t: torch.Tensor, first_head: int) -> bool:  # a block is one span of the copied heads
        return first_head == 0 and t.stride(4) == head_dim and t.stride(3) == heads * head_dim \
            and t.stride(2) == block_size * heads * head_dim
    is_dense = dense(src, h0) and dense(dst, dst_first_head)
    _kernels().copy_blocks[(layers * two, src_ids.numel())](
        src, dst, src_ids, dst_ids, h0, dst_first_head, *src.stride()[1:5], *dst.stride()[1:5],
        HEADS=heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, CHUNK=4096 if is_dense else 1024, DENSE=is_dense,
        num_warps=8 if is_dense else 4)


def _ids(block_ids: list[int], device) -> torch.Tensor:
    return long_tensor(block_ids, device)


def gather_blocks(kv: torch.Tensor, block_ids: list[int], heads: tuple[int, int] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`[layers, 2, n, block_size, heads in slice, head_dim]`, contiguous; into `out` when given."""
    heads = heads or (0, kv.shape[4])
    idx = _ids(block_ids, kv.device)
    shape = (*kv.shape[:2], idx.numel(), kv.shape[3], heads[1] - heads[0], kv.shape[5])
    out = torch.empty(shape, dtype=kv.dtype, device=kv.device) if out is None else out
    assert out.is_contiguous()
    _copy_blocks(kv, idx, heads, out, torch.arange(idx.numel(), device=kv.device), 0)
    return out


def scatter_blocks(kv: torch.Tensor, block_ids: list[int], data: torch.Tensor,
                   heads: tuple[int, int] | None = None) -> None:
    """Write `data` (as `gather_blocks` returns it) into `block_ids` (and the head slice)."""
    idx = _ids(block_ids, kv.device)
    data = data.contiguous()
    _copy_blocks(data, torch.arange(idx.numel(), device=kv.device), (0, data.shape[4]), kv, idx,
                 (heads or (0, kv.shape[4]))[0])


def copy_blocks(src: torch.Tensor, src_ids: list[int], heads: tuple[int, int], kv: torch.Tensor,
                dst_ids: list[int]) -> None:
    """Blocks `src_ids` of another cache `src` (heads `heads` of it) into blocks `dst_ids` of `kv`, in
    one pass: no staging buffer. Asynchronous on the current stream."""
    ids = _ids([*src_ids, *dst_ids], kv.device)  # one host-to-device copy: it waits for the host, on a pull's path
    _copy_blocks(src, ids[:len(src_ids)], heads, kv, ids[len(src_ids):], 0)
