"""The Triton kernels against the torch path, on fresh random inputs every run: under the Triton
interpreter on CPU (small shapes), natively on a GPU when there is one."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter or compiled mode once per process: interpret on a machine without a
# GPU, compile for the GPU where there is one (then these run on cuda only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pdserve.engine.kernels import paged_attention as ref  # noqa: E402
from pdserve.engine.kernels import triton_paged as tk  # noqa: E402
from pdserve.kvtransfer import blocks as ref_blocks  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
BLOCK, HEAD_DIM, HEADS, KV_HEADS, NUM_BLOCKS = 16, 16, 4, 2, 24


def cache(device, dtype=torch.float32):
    """K and V caches; bf16 under fp32 queries as `kv_cache_dtype: bfloat16` makes them."""
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def tables_for(lens, device):
    """Each sequence's blocks: distinct, shuffled physical ids (padding: block 0)."""
    perm = torch.randperm(NUM_BLOCKS).tolist()
    need = [-(-n // BLOCK) for n in lens]
    rows, at = [], 0
    for k in need:
        rows.append(perm[at:at + k] + [0] * (max(need) - k))
        at += k
    return torch.tensor(rows, dtype=torch.long, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_blocks", [None, 1, 2])  # one partition (the default here), or several
def test_decode_attention_matches_torch(device, kv_dtype, partition_blocks):
    k_cache, v_cache = cache(device, kv_dtype)
    lens = [1, 17, 33, 48, 80]  # one token; mid-block ends; full last blocks
    tables = tables_for(lens, device)
    seq_lens = torch.tensor(lens, device=device)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device=device)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    got = tk.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, partition_blocks)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_decode_partitions_cover_any_table_width():
    assert tk.decode_partition_blocks(1) == 32 and tk.decode_partition_blocks(64 * 32) == 32
    assert tk.decode_partition_blocks(64 * 32 + 1) == 64  # past 32k tokens of 16: longer partitions
    assert -(-8192 // tk.decode_partition_blocks(8192)) == 64  # 128k tokens in 64 partitions


def test_small_batches_split_the_context_finer():
    """Batch 1 of an 8B model (8 KV heads) on 132 SMs: partitions of a tile (4 blocks) over a short
    table, of 8 blocks over an 8k-token one; batch 64 keeps 32-block partitions."""
    assert tk.decode_partition_blocks(12, 8, 132) == 4
    assert tk.decode_partition_blocks(512, 8, 132) == 8
    assert tk.decode_partition_blocks(64, 64 * 8, 132) == 32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_torch(device, kv_dtype):
    """K and V views of a qkv projection (heads at a stride) into their slots, as the torch path."""
    # Values a bf16 cache holds exactly: Triton's interpreter rounds to bf16 otherwise than torch.
    qkv = torch.randn(5, 4 + 2 * KV_HEADS, HEAD_DIM, device=device).to(kv_dtype).float()
    k, v = qkv[:, 4:4 + KV_HEADS], qkv[:, 4 + KV_HEADS:]
    slots = torch.tensor([3, 17, 40, 41, 90], device=device)
    got_k, got_v = cache(device, kv_dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    tk.write_kv(k, v, got_k, got_v, slots)
    ref.write_kv(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m", [16, 64])  # several query tiles per chunk, or one
def test_prefill_attention_varlen_batch_matches_torch(device, kv_dtype, block_m):
    k_cache, v_cache = cache(device, kv_dtype)
    # (cached prefix, chunk): nothing cached; a prefix over several blocks ending mid-block; a
    # chunk of one token after a long prefix.
    chunks = [(0, 20), (37, 11), (60, 1)]
    contexts = [c + q for c, q in chunks]
    tables = tables_for(contexts, device)
    q_lens = [q for _, q in chunks]
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=device)
    expected, start = [], 0
    for (cached, q_len), context, table in zip(chunks, contexts, tables):
        # The chunk's own K/V as the torch path takes them (already in the cache).
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, context)], device=device)
        k_new = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        v_new = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        expected.append(ref.paged_prefill_attention(q[start:start + q_len], k_new, v_new, k_cache, v_cache, table,
                                                    context, 0.25))
        start += q_len
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device)
    got = tk.paged_prefill_attention(q, k_cache, v_cache, cu, torch.tensor(contexts, device=device), tables, 0.25,
                                     block_m)
    torch.testing.assert_close(got, torch.cat(expected), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_block_gather_and_scatter_match_torch(device, heads):
    kv = torch.randn(2, 2, 12, 4, 2, 8, device=device)
    ids = [9, 2, 7]
    got = tk.gather_blocks(kv, ids, heads)
    assert torch.equal(got, ref_blocks.gather_blocks(kv, ids, heads))
    dst = torch.zeros_like(kv)
    tk.scatter_blocks(dst, [0, 5, 11], got, heads)
    h0, h1 = heads or (0, 2)
    assert torch.equal(dst[:, :, [0, 5, 11], :, h0:h1], got)
    assert not dst[:, :, [1, 2, 3, 4, 6, 7, 8, 9, 10]].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(0, 2), (1, 2)])
def test_copy_blocks_between_caches_matches_numpy_path(device, heads):
    """Another cache's blocks (a head slice of them) straight into this one's, as a local KV read
    on a GPU does; the same as the CPU path (`kvtransfer.blocks.copy_blocks` over numpy)."""
    src = torch.randn(2, 2, 12, 4, 2, 8, device=device)
    kv = torch.zeros(2, 2, 10, 4, heads[1] - heads[0], 8, device=device)
    tk.copy_blocks(src, [9, 2, 3, 4], heads, kv, [0, 1, 2, 7])
    expected = torch.zeros_like(kv, device="cpu")
    ref_blocks.copy_blocks(ref_blocks._bits(src.cpu()), [9, 2, 3, 4], heads, expected, [0, 1, 2, 7])
    assert torch.equal(kv.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU branch of kvtransfer.blocks.copy_blocks")
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 8), (torch.float32, 8), (torch.float16, 6)])
@pytest.mark.parametrize("src_ids,dst_ids", [([2, 3, 4], [5, 6, 7]), ([9, 2, 3, 4], [0, 1, 2, 7]),
                                             ([2, 3, 4], [0, 1, 7]), ([6], [1])])
@pytest.mark.parametrize("heads", [(0, 2), (1, 2)])
def test_gpu_copy_blocks_by_runs_or_ids_matches_numpy_path(dtype, head_dim, src_ids, dst_ids, heads):
    """`kvtransfer.blocks.copy_blocks` on a GPU: one strided copy when both sides are one run
    (int64 loads where a row is whole int64s; head_dim 6 of fp16 is not), else the kernel over
    the ids; the same bytes as the CPU path either way."""
    src = torch.randn(2, 2, 12, 4, 2, head_dim, device="cuda").to(dtype)
    kv = torch.zeros(2, 2, 10, 4, heads[1] - heads[0], head_dim, device="cuda", dtype=dtype)
    ref_blocks.copy_blocks(src, src_ids, heads, kv, dst_ids)
    expected = torch.zeros_like(kv, device="cpu")
    ref_blocks.copy_blocks(ref_blocks._bits(src.cpu()), src_ids, heads, expected, dst_ids)
    assert torch.equal(kv.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU branch of kvtransfer.blocks.copy_blocks")
@pytest.mark.parametrize("src_ids,dst_ids", [([11, 12], [0, 1]), ([0, 1], [9, 10]), ([-1, 0], [0, 1]),
                                             ([3, 12], [0, 1]), ([3, 2], [-1, 4])])
def test_gpu_copy_blocks_refuses_ids_outside_either_cache(src_ids, dst_ids):
    """Runs (checked by their ends) and ids that are no run alike, before anything is launched."""
    src = torch.randn(2, 2, 12, 4, 2, 8, device="cuda")
    kv = torch.zeros(2, 2, 10, 4, 2, 8, device="cuda")
    with pytest.raises(IndexError):
        ref_blocks.copy_blocks(src, src_ids, (0, 2), kv, dst_ids)
    assert not kv.any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_step_runs_its_prefill_chunks_in_one_launch(device):
    """`ops`' Triton path on decodes followed by two prefill chunks (one varlen launch for both,
    from the step's shared `PrefillBatch`) equals the torch kernels run one by one."""
    from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta
    from pdserve.engine.kernels import ops

    k_cache, v_cache = cache(device)
    decode_lens, chunks = [5, 40], [(0, 9), (21, 6)]  # (cached prefix, chunk)
    contexts = [c + n for c, n in chunks]
    tables = tables_for(decode_lens + contexts, device)
    nd, q_lens = len(decode_lens), [n for _, n in chunks]
    q = torch.randn(nd + sum(q_lens), HEADS, HEAD_DIM, device=device)
    prefills, start = [], nd
    for (cached, n), context, table in zip(chunks, contexts, tables[nd:]):
        prefills.append(PrefillChunkMeta(start, n, context, table[:-(-context // BLOCK)]))
        start += n
    meta = AttentionMetadata(torch.empty(0), nd, tables[:nd], torch.tensor(decode_lens, device=device), prefills)
    got = torch.empty_like(q)
    got[:nd] = tk.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                         0.25)
    ops._prefill_triton(q, k_cache, v_cache, prefills[0].query_start, meta.prefill_batch(), 0.25, got)

    expected = [ref.paged_decode_attention(q[:nd], k_cache, v_cache, tables[:nd], meta.decode_seq_lens, 0.25)]
    for p, (cached, _) in zip(prefills, chunks):
        slots = torch.tensor([p.block_table[i // BLOCK] * BLOCK + i % BLOCK for i in range(cached, p.context_len)],
                             device=device)
        k_new, v_new = (c.view(-1, KV_HEADS, HEAD_DIM)[slots] for c in (k_cache, v_cache))
        expected.append(ref.paged_prefill_attention(q[p.query_start:p.query_start + p.query_len], k_new, v_new,
                                                    k_cache, v_cache, p.block_table, p.context_len, 0.25))
    torch.testing.assert_close(got, torch.cat(expected), atol=2e-5, rtol=2e-5)
    assert meta.prefill_batch() is meta.prefill_batch()  # built once a step, shared by every layer
