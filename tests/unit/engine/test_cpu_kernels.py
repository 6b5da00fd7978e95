"""The C kernels against the torch path, on fresh random inputs every run, and their build and
fallback behaviour. (The engine's parity tests against transformers run through them too; the
AVX2 and plain C builds run these tests in tests/integration/engine/test_cpu_kernels_builds.py.)"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels, ops
from pdserve.engine.kernels import paged_attention as ref
from pdserve.engine.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding


def random_case(batch, heads, kv_heads, head_dim, block_size, max_len, num_blocks=64, kv_dtype=torch.float32):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    lens = torch.randint(1, max_len + 1, (batch,))
    lens[0] = 1  # a single token
    if batch > 1:
        lens[1] = block_size * (max_len // block_size) or 1  # ends exactly on a block boundary
    width = int(-(-lens.max() // block_size))
    tables = torch.randint(0, num_blocks, (batch, width))  # shared and repeated blocks are fine to read
    # q as the model passes it: a strided view into a fused qkv projection.
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim)
    return qkv[:, :heads], k_cache, v_cache, tables, lens


def test_the_kernel_builds_on_this_machine():
    # CI has a C compiler: a silent fallback would leave the kernel untested by the engine tests.
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,max_len", [
    (8, 4, 64, 16, 300),   # the benchmark model's shape (GQA 2)
    (4, 4, 32, 16, 40),    # MHA
    (8, 1, 128, 16, 70),   # MQA, wide heads
    (8, 2, 32, 16, 50),    # GQA 4 (Llama 3 8B's grouping), head dim under 64
    (4, 2, 80, 8, 37),     # head dim 64 + 16 (AVX-512's loops take it in two widths)
    (6, 2, 24, 5, 33),     # odd sizes everywhere
    (2, 2, 16, 1, 9),      # one token per block
])
@pytest.mark.parametrize("batch", [3, 40])  # work split by KV head; whole sequences per thread
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(heads, kv_heads, head_dim, block_size, max_len, batch, kv_dtype):
    q, k_cache, v_cache, tables, lens = random_case(batch, heads, kv_heads, head_dim, block_size, max_len,
                                                    kv_dtype=kv_dtype)
    assert cpu_kernels.usable(q) and cpu_kernels.usable_cache(k_cache)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow():
    q, k_cache, v_cache, tables, lens = random_case(3, 4, 2, 32, 16, 50)
    # Scores in the thousands (exp without the running max would overflow), from small integers so
    # that every dot product is exact in float32 whatever the summation order: rounded scores of
    # that size would differ between kernel and reference by ~1e-3 before any softmax.
    q.copy_(torch.randint(-20, 21, q.shape))
    k_cache.copy_(torch.randint(-20, 21, k_cache.shape))
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (8, 4, 64, 16),   # the benchmark model's shape (GQA 2)
    (4, 4, 32, 16),   # MHA
    (8, 1, 128, 16),  # MQA, wide heads
    (6, 2, 24, 5),    # odd sizes everywhere
])
@pytest.mark.parametrize("context_len,q_len", [(1, 1), (70, 70), (300, 300), (300, 37), (53, 1)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_matches_torch(heads, kv_heads, head_dim, block_size, context_len, q_len, kv_dtype,
                                      threads, monkeypatch):
    # A chunk of q_len queries at the end of context_len positions (q_len < context_len: a cached
    # prefix before it), its K/V already in the cache as the engine writes them first.
    num_blocks = -(-context_len // block_size)
    k_cache = torch.randn(num_blocks + 5, block_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn(num_blocks + 5, block_size, kv_heads, head_dim).to(kv_dtype)
    table = torch.randperm(num_blocks + 5)[:num_blocks]
    fresh = [k_cache, v_cache]
    for i, cache in enumerate(fresh):
        rows = cache.index_select(0, table).view(-1, kv_heads, head_dim)[context_len - q_len:context_len]
        fresh[i] = rows.float()
    qkv = torch.randn(q_len, heads + 2 * kv_heads, head_dim)
    q = qkv[:, :heads]  # a strided view, as the model passes it
    expected = ref.paged_prefill_attention(q, *fresh, k_cache, v_cache, table, context_len, head_dim ** -0.5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, context_len, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    # Into a slice of a larger output, as the attention layer passes it.
    out = torch.full((q_len + 3, heads, head_dim), float("nan"))
    cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, context_len, head_dim ** -0.5, out[2:2 + q_len])
    torch.testing.assert_close(out[2:2 + q_len], expected, atol=2e-5, rtol=2e-5)
    assert out[:2].isnan().all() and out[2 + q_len:].isnan().all()


def test_prefill_kernel_with_large_scores_does_not_overflow():
    k_cache = torch.randn(8, 16, 2, 32)
    v_cache = torch.randn(8, 16, 2, 32)
    table = torch.arange(8)
    q = torch.randn(100, 4, 32) * 200
    k = k_cache.view(-1, 2, 32)[:100]
    v = v_cache.view(-1, 2, 32)[:100]
    expected = ref.paged_prefill_attention(q, k, v, k_cache, v_cache, table, 100, 1.0)
    got = cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, 100, 1.0)
    assert torch.isfinite(got).all()
    # Scores near 1,000 carry ~1e-4 of rounding from the order of their sums, and the softmax
    # turns that into relative weight errors of the same size: 12,800 outputs sit within 2e-3.
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_only_fp32_cpu_tensors_with_a_dense_last_dimension_are_taken():
    q, k_cache, v_cache, _, _ = random_case(2, 4, 2, 16, 16, 20)
    assert cpu_kernels.usable(q, k_cache)
    assert not cpu_kernels.usable(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_kernels.usable(q, k_cache.transpose(2, 3))
    # The KV cache may hold bf16 (kv_cache_dtype), never fp16, and must be dense.
    assert cpu_kernels.usable_cache(k_cache) and cpu_kernels.usable_cache(k_cache.bfloat16())
    assert not cpu_kernels.usable_cache(k_cache.half())
    assert not cpu_kernels.usable_cache(k_cache.transpose(2, 3))


@pytest.mark.parametrize("rows,dim", [(1, 512), (64, 512), (300, 200), (3, 13)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(rows, dim, with_residual):
    x, delta, weight = torch.randn(rows, dim) * 3, torch.randn(rows, dim), torch.rand(dim) + 0.5
    h = x + delta if with_residual else x.clone()
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    got = cpu_kernels.rms_norm(x, weight, 1e-5, delta if with_residual else None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x, h)  # the residual stream took the add, in place


@pytest.mark.parametrize("rows,dim", [(1, 1408), (64, 1408), (5, 21)])
def test_silu_mul_matches_torch(rows, dim):
    gate_up = torch.randn(rows, 2 * dim) * 8  # large |x| on both sides: no overflow in the sigmoid
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    expected = F.silu(gate_up[:, :dim]) * gate_up[:, dim:]
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (40, 6, 32), (3, 3, 10)])
def test_rotary_matches_torch_in_place_on_a_strided_view(tokens, heads, head_dim):
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, 512)
    table = rope.table(torch.randint(0, 512, (tokens,)))
    qkv = torch.randn(tokens, heads + 4, head_dim)  # rotate the first `heads`, leave the rest
    cos, sin = table[:, None, 0], table[:, None, 1]
    x1, x2 = qkv[:, :heads].chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    untouched = qkv[:, heads:].clone()
    cpu_kernels.rotary_(qkv[:, :heads], table)
    torch.testing.assert_close(qkv[:, :heads], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, heads:], untouched)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 12, 13, 25, 64, 200])  # every kind of register tiling
@pytest.mark.parametrize("out_features,in_features", [
    (48, 32),    # whole panels
    (37, 19),    # a partial last panel, an odd inner dimension
    (3, 1),      # narrower than one panel, inner dimension 1
])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_torch(rows, out_features, in_features, with_bias, packed_dtype):
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    bias = torch.randn(out_features) if with_bias else None
    packed = cpu_kernels.pack_linear(w, dtype=packed_dtype)
    assert packed.dtype == packed_dtype
    got = cpu_kernels.linear(x, packed, out_features, bias)
    # bf16 panels: the weights rounded as torch rounds, then fp32 products and sums.
    torch.testing.assert_close(got, F.linear(x, w.to(packed_dtype).float(), bias), atol=1e-4, rtol=1e-4)
    if packed_dtype == torch.bfloat16:  # widened exactly: the fp32 kernel over the rounded weights, bit for bit
        rounded = cpu_kernels.pack_linear(w.bfloat16().float())
        assert torch.equal(got, cpu_kernels.linear(x, rounded, out_features, bias))


@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_result_in_any_batch(packed_dtype):
    # How a batch's rows are tiled depends on its size; a request's output must not (greedy
    # decoding gives the same text whatever else is in the batch). One row alone is another path.
    w, x, bias = torch.randn(37, 40), torch.randn(30, 40), torch.randn(37)
    packed = cpu_kernels.pack_linear(w, dtype=packed_dtype)
    whole = cpu_kernels.linear(x, packed, 37, bias)
    for m in range(2, 30):
        assert torch.equal(cpu_kernels.linear(x[:m], packed, 37, bias), whole[:m]), m


def test_linear_at_the_benchmark_model_shapes_threaded():
    # Big enough that the panels split over threads and the rows over L2-sized blocks.
    for n, k in [(1024, 512), (512, 1408)]:
        w = torch.randn(n, k)
        packed = cpu_kernels.pack_linear(w)
        for rows in (1, 7, 300):
            x = torch.randn(rows, k)
            torch.testing.assert_close(cpu_kernels.linear(x, packed, n, None), F.linear(x, w),
                                       atol=2e-4, rtol=1e-4)


def test_linear_takes_a_strided_input_and_keeps_leading_dimensions():
    w = torch.randn(24, 16)
    x = torch.randn(3, 5, 32)[..., ::2]  # last dimension strided
    got = cpu_kernels.linear(x, cpu_kernels.pack_linear(w), 24, None)
    assert got.shape == (3, 5, 24)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert cpu_kernels.linear(torch.randn(0, 16), cpu_kernels.pack_linear(w), 24, None).shape == (0, 24)


@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16])
def test_weights_packed_into_one_arena_lie_back_to_back_from_a_2mib_boundary(checkpoints, packed_dtype):
    shapes = [(24, 16), (40, 24), (7, 33)]
    buffers = cpu_kernels.packed_arena(shapes, packed_dtype)
    size = buffers[0].element_size()
    assert buffers[0].data_ptr() % (2 << 20) == 0 and buffers[0].dtype == packed_dtype
    for (n, k), buf, nxt in zip(shapes, buffers, buffers[1:] + [None]):
        assert buf.numel() == cpu_kernels.packed_elements(n, k)
        if nxt is not None:
            assert buf.data_ptr() + size * buf.numel() == nxt.data_ptr()
    for (n, k), buf in zip(shapes, buffers):
        w, x = torch.randn(n, k), torch.randn(3, k)
        assert cpu_kernels.pack_linear(w, buf) is buf
        torch.testing.assert_close(cpu_kernels.linear(x, buf, n, None), F.linear(x, w.to(packed_dtype).float()),
                                   atol=1e-5, rtol=1e-5)
    # A loaded model's linears: one arena, in the order a decode step reads them.
    from pdserve.engine.models.loader import load_model

    for preset in ("tiny-llama", "tiny-qwen2"):  # qwen2: the LM head packs the tied embedding
        model, _ = load_model(checkpoints[preset], weight_dtype=packed_dtype)
        packed = [lin.packed for layer in model.model.layers for lin in
                  (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        packed.append(model.lm_head.packed)
        assert all(a.dtype == packed_dtype for a in packed)
        assert all(a.data_ptr() + size * a.numel() == b.data_ptr() for a, b in zip(packed, packed[1:]))


def test_pack_linear_refuses_other_dtypes():
    with pytest.raises(ValueError, match="packed weights hold"):
        cpu_kernels.pack_linear(torch.randn(4, 4), dtype=torch.float16)


def test_linear_layer_packs_for_the_kernel_or_for_onednn(monkeypatch):
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(7, 24)
    outputs = {}
    for switch in ("auto", "torch"):
        monkeypatch.setenv("PDSERVE_CPU_KERNELS", switch)
        layer = ColumnParallelLinear(24, 40, bias=True)
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(b)
        layer.finalize()
        outputs[layer.packed_for] = layer(x)
    assert set(outputs) == {"pdserve", "onednn"}
    for got in outputs.values():
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_layers_take_the_same_values_on_both_paths(monkeypatch):
    """RMSNorm (with the residual add) and rotary through the layer classes, kernels on and off."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    rope = RotaryEmbedding(16, 128, 10000.0, None, 128)
    x, add, heads = torch.randn(9, 64), torch.randn(9, 64), torch.randn(9, 6, 16)
    table = rope.table(torch.arange(9))

    def run():
        h = x.clone()
        return norm(h, add=add), h, RotaryEmbedding.apply(heads.clone()[:, :4], table)

    fast = run()
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    slow = run()
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_env_chooses_the_torch_path(monkeypatch):
    q, k_cache, _, _, _ = random_case(2, 4, 2, 16, 16, 20)
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    assert not cpu_kernels.usable(q, k_cache)


def test_a_failed_build_raises_with_the_compiler_output(tmp_path):
    with pytest.raises(cpu_kernels.KernelBuildError, match="failed"):
        cpu_kernels.build("/bin/false", tmp_path)
    assert not list(tmp_path.iterdir())  # no half-written library left behind


def test_without_a_compiler_attention_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "no C compiler" in caplog.text
    q, k_cache, _, _, _ = random_case(2, 4, 2, 16, 16, 20)
    assert not cpu_kernels.usable(q, k_cache)


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100, 32000])
def test_argmax_matches_torch(n):
    """Greedy sampling's argmax: the first index of the largest value; of the first NaN if any
    (torch's rule); ties and -inf rows included."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = float("-inf")
    x[2, n // 3] = x[2, (2 * n) // 3] = 1e9  # a tie: the first wins
    x[3, n // 2] = float("nan")
    x[4, -1] = float("inf")
    x[5] = torch.randint(0, 3, (n,), generator=g).float()  # many ties
    assert cpu_kernels.argmax(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("n,words", [(32000, 1000), (50, 2), (50, 1), (33, 2), (7, 1)])
def test_token_bitmask_matches_torch(n, words):
    """A grammar's packed mask (bit t % 32 of word t // 32): every token whose bit is clear, and
    every token past the mask's 32 * words, becomes -inf; the rest are copied, NaN and inf
    included; whole words of ones and of zeros (the fast paths) and partial ones alike."""
    g = torch.Generator().manual_seed(n + words)
    x = torch.randn(5, n, generator=g)
    x[0, 0], x[0, -1] = float("nan"), float("inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    bitmask[3, 0] = -1
    allowed = torch.tensor([[t < 32 * words and bool(int(bitmask[r, t // 32]) >> (t % 32) & 1) for t in range(n)]
                            for r in range(5)])
    expected = torch.where(allowed, x, torch.tensor(float("-inf")))
    out = cpu_kernels.token_bitmask(x, bitmask)
    torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(ops._token_bitmask_torch(x, bitmask), expected, equal_nan=True, rtol=0, atol=0)
    assert ops.token_bitmask(x, bitmask).data_ptr() != x.data_ptr()  # a copy: the logits stay as they are
