"""The C decode-attention kernel against the torch path, on fresh random inputs every run, and
its build and fallback behaviour."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.kernels import cpu_attention
from pdserve.engine.kernels import paged_attention as ref


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
    assert cpu_attention.load() is not None


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
    assert cpu_attention.supports(q, k_cache)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow():
    q, k_cache, v_cache, tables, lens = random_case(3, 4, 2, 32, 16, 50)
    q = q * 200  # scores in the thousands: exp without the running max would overflow
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_only_fp32_cpu_and_dense_caches_are_taken():
    q, k_cache, v_cache, _, _ = random_case(2, 4, 2, 16, 16, 20)
    assert not cpu_attention.supports(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_attention.supports(q, k_cache.transpose(1, 2))


def test_env_chooses_the_torch_path(monkeypatch):
    q, k_cache, _, _, _ = random_case(2, 4, 2, 16, 16, 20)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    assert not cpu_attention.supports(q, k_cache)


def test_a_failed_build_raises_with_the_compiler_output(tmp_path):
    with pytest.raises(cpu_attention.KernelBuildError, match="failed"):
        cpu_attention.build("/bin/false", tmp_path)
    assert not list(tmp_path.iterdir())  # no half-written library left behind


def test_without_a_compiler_attention_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_attention, "_tried", False)
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert cpu_attention.load() is None
    assert "no C compiler" in caplog.text
    q, k_cache, _, _, _ = random_case(2, 4, 2, 16, 16, 20)
    assert not cpu_attention.supports(q, k_cache)
