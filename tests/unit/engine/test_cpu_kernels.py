"""The C kernels against the torch path, on fresh random inputs every run, and their build and
fallback behaviour. (The engine's parity tests against transformers run through them too; the
AVX2 and plain C builds run these tests in tests/integration/engine/test_cpu_kernels_builds.py.)"""

from __future__ import annotations

import logging
from array import array

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels
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


@pytest.mark.parametrize("preset,kv_cache_dtype,weight_dtype", [
    ("tiny-llama", "auto", "auto"), ("tiny-qwen2", "auto", "auto"),  # qwen2: qkv bias, tied embeddings
    ("tiny-llama", "bfloat16", "auto"), ("tiny-llama", "auto", "bfloat16"), ("tiny-qwen2", "bfloat16", "bfloat16")])
def test_decode_steps_in_one_call_match_the_layer_by_layer_path(checkpoints, preset, kv_cache_dtype, weight_dtype,
                                                                monkeypatch):
    """A decode-only step runs in one C call from token ids to logits (`DecoderModel`); the same
    requests through the Python layers give the same tokens and logprobs, and leave the same bits
    in the KV cache (bf16: the C side rounds as torch does). Sequences of different lengths decode
    together, so attention reads different block tables in one call."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    calls = []
    step = cpu_kernels.DecoderModel.decode_step
    monkeypatch.setattr(cpu_kernels.DecoderModel, "decode_step",
                        lambda self, *a, **kw: calls.append(1) or shapes.append(self.shape) or step(self, *a, **kw))
    shapes = []
    prompts = [list(range(5, 5 + n)) for n in (1, 9, 16, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)

    def generate(in_c: bool):
        llm = LLM(checkpoints[preset], block_size=4, kv_cache_dtype=kv_cache_dtype, weight_dtype=weight_dtype)
        llm.engine.model._all_in_c = in_c
        outputs = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]
        return outputs, llm.engine.kv_cache.kv

    fused, fused_kv = generate(True)
    assert calls, "no decode step went through the one-call path"
    calls.clear()
    layered, layered_kv = generate(False)
    assert not calls
    assert fused_kv.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    assert (shapes[0].weight_bf16, shapes[0].kv_bf16) == (weight_dtype == "bfloat16", kv_cache_dtype == "bfloat16")
    assert torch.equal(fused_kv, layered_kv)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, layered):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


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


def test_greedy_tokens_from_the_decode_step_are_its_logits_argmax(checkpoints, monkeypatch):
    """When every request only needs its argmax, the C decode step picks it as it writes the logits
    (each thread scans its own columns, then the threads' winners are compared): the same tokens as
    argmax over the logits, ties and NaN included, with the LM head split between two threads."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(checkpoints["tiny-llama"], block_size=4)
        calls = []
        step = cpu_kernels.DecoderModel.decode_step
        monkeypatch.setattr(cpu_kernels.DecoderModel, "decode_step",
                            lambda self, *a, **kw: calls.append((self, a, kw)) or step(self, *a, **kw))
        prompts = [list(range(5, 5 + n)) for n in (1, 9, 16, 17, 40)]
        greedy = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        self, (ints, m, width), kw = calls[-1]
        assert m == len(prompts) and kw == {"greedy": True}, "plain greedy requests take their tokens from the step"
        # Same tokens as sampling from the logits (logprobs asked for: the sampler runs).
        sampled = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))
        assert [o.token_ids for o in greedy] == [o.token_ids for o in sampled]

        head = llm.engine.model.lm_head
        panels = head.packed.view(-(-head.out_features // 16), -1, 16)  # [panels, in, 16]
        vocab = head.out_features
        original = head.packed.clone()

        def column(c: int) -> torch.Tensor:
            return panels[c // 16, :, c % 16]

        # (column, value) pairs over an all-zero head; [] alone: every logit 0, the first index wins.
        cases = [[], [(vocab - 3, float("nan")), (4, 1.0)], [(3, float("nan")), (vocab - 5, float("nan"))],
                 [(vocab - 10, 0.5)], [(vocab - 10, -0.5), (7, 0.5)]]
        _, tokens = step(self, ints, m, width, True)
        assert tokens == step(self, ints, m, width, False)[0].argmax(dim=-1).tolist()
        for case in cases:
            head.packed.zero_()
            for c, value in case:
                column(c).fill_(value)
            logits, tokens = step(self, ints, m, width, True)
            assert tokens == logits.argmax(dim=-1).tolist(), case
        head.packed.copy_(original)
    finally:
        torch.set_num_threads(threads)


# -- The decode step's threads (pdserve_decoder) -------------------------------------------------
@pytest.fixture
def decode_steps(checkpoints, monkeypatch):
    """A tiny model after generating, and the decode steps it ran in one call: (ints, m, width)
    each. Twelve sequences of different lengths finish at different times (the batch shrinks from
    12), and the longest spans 24 blocks of 4 tokens."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(checkpoints["tiny-llama"], block_size=4)
    steps = []
    step = cpu_kernels.DecoderModel.decode_step
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels.DecoderModel, "decode_step",
                  lambda self, ints, m_, width, greedy=False: steps.append((array("q", ints), m_, width))
                  or step(self, ints, m_, width, greedy))
        prompts = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 20, 33, 40, 41, 52, 64, 80)]
        params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
        llm.generate(prompts, params)
    assert max(m_ for _, m_, _ in steps) == 12 and max(w for _, _, w in steps) > 16
    return llm, steps


def _replay(llm, steps, threads: int, chaos: tuple[int, int] | None, start: torch.Tensor):
    """The steps again on a fresh decoder (matmuls split into one-panel items) from the same cache
    contents: each step's logits and greedy tokens, and the decoder's counters."""
    model, kv = llm.engine.model, llm.engine.kv_cache
    kv.kv.copy_(start)
    decoder = model._model_for_c(kv)
    if chaos:
        decoder.chaos(*chaos)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [decoder.decode_step(ints, m, width, greedy=True) for ints, m, width in steps], decoder.stats()
    finally:
        torch.set_num_threads(before)


def test_decode_step_results_do_not_depend_on_which_thread_computed_what(decode_steps, monkeypatch):
    """The decoder's threads share each phase's items and redo those a stalled thread sits on; a
    thread that wakes after its step has ended drops what it computed. Whatever the thread count
    and however threads stall (randomly here, for up to 0.5 ms before publishing and when a step
    begins, so late threads run into the following steps; 4 threads on 2 cores are descheduled
    too), every step's logits and tokens are the same bits as one thread's. The steps are replayed
    newest first, so the batch grows from 1 to 12 rows (the decoder's buffers grow mid-run)."""
    llm, steps = decode_steps
    monkeypatch.setattr(cpu_kernels, "DECODE_ITEM_BYTES", 1)  # one panel per item: many items per matmul
    steps = steps[::-1]
    start = llm.engine.kv_cache.kv.clone()
    expected, _ = _replay(llm, steps, 1, None, start)
    for threads, chaos in [(2, None), (2, (100, 500)), (4, (100, 500))]:
        got, stats = _replay(llm, steps, threads, chaos, start)
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert torch.equal(logits, want_logits) and tokens == want_tokens, (threads, chaos)
        assert stats["steps"] == len(steps)
        if chaos:  # the stalls did make threads take over items and drop late results
            assert stats["redone"] > 0 and stats["dropped"] > 0, stats
        assert stats["stolen"] > 0, stats


def test_decode_step_rejects_out_of_range_inputs(decode_steps):
    """Indices are checked before anything runs: a bad token id, position, slot, length or block id
    raises ValueError and leaves the cache as it was."""
    llm, steps = decode_steps
    decoder = llm.engine.model.c_decoder(llm.engine.kv_cache)
    ints, m, width = steps[0]
    vocab, slots = decoder.shape.vocab, decoder.shape.num_blocks * decoder.shape.block_size
    before = llm.engine.kv_cache.kv.clone()
    for field, value in [(0, vocab), (0, -1), (1, decoder.shape.max_position), (2, slots), (3, 0),
                         (3, width * decoder.shape.block_size + 1), (4, decoder.shape.num_blocks)]:
        bad = array("q", ints)
        bad[field * m] = value
        with pytest.raises(ValueError, match="out of range"):
            decoder.decode_step(bad, m, width)
    assert torch.equal(llm.engine.kv_cache.kv, before)


def test_a_decoder_with_stalled_threads_frees_promptly(decode_steps):
    """Freeing a decoder joins its threads, stalled ones included (each finishes its item first)."""
    import time

    llm, steps = decode_steps
    decoder = llm.engine.model._model_for_c(llm.engine.kv_cache)
    decoder.chaos(1000, 20000)  # every thread sleeps up to 20 ms before every publish
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        decoder.decode_step(*steps[0])
    finally:
        torch.set_num_threads(before)
    start = time.monotonic()
    decoder._free()
    assert time.monotonic() - start < 5
