"""The C kernels against the torch path, on fresh random inputs every run, and their build and
fallback behaviour. (The engine's parity tests against transformers run through them too.)"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.kernels import paged_attention as ref
from pdserve.engine.models.layers import RMSNorm, RotaryEmbedding


def random_case(batch, heads, kv_heads, head_dim, block_size, max_len, num_blocks=64):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
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
    (6, 2, 24, 5, 33),     # odd sizes everywhere
    (2, 2, 16, 1, 9),      # one token per block
])
@pytest.mark.parametrize("batch", [3, 40])  # work split by KV head; whole sequences per thread
def test_kernel_matches_torch(heads, kv_heads, head_dim, block_size, max_len, batch):
    q, k_cache, v_cache, tables, lens = random_case(batch, heads, kv_heads, head_dim, block_size, max_len)
    assert cpu_kernels.usable(q, k_cache)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow():
    q, k_cache, v_cache, tables, lens = random_case(3, 4, 2, 32, 16, 50)
    q = q * 200  # scores in the thousands: exp without the running max would overflow
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_only_fp32_cpu_tensors_with_a_dense_last_dimension_are_taken():
    q, k_cache, v_cache, _, _ = random_case(2, 4, 2, 16, 16, 20)
    assert cpu_kernels.usable(q, k_cache)
    assert not cpu_kernels.usable(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_kernels.usable(q, k_cache.transpose(2, 3))


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
