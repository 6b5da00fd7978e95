"""The fused Triton kernels (norm, rotary, SwiGLU) against the torch path in `ops.py`, on fresh
random inputs every run: under the Triton interpreter on CPU (small shapes), natively on a GPU
when there is one. Then `ops`' choice of kernel on CPU tensors.

Tolerances: fp32 1e-5; bf16 and fp16 one step of the dtype for each rounding the kernel and torch
may do the other way. Under the interpreter bf16 gets one more: it truncates fp32 to bf16 where
compiled code, like torch, rounds to nearest even.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# Triton picks interpreter or compiled mode once per process: interpret on a machine without a
# GPU, compile for the GPU where there is one (then these run on cuda only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.kernels import cpu_kernels, ops  # noqa: E402
from pdserve.engine.kernels import triton_fused as tf  # noqa: E402
from pdserve.engine.models.layers import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # a rounding step, relative, at most
needs_triton = pytest.mark.skipif(not tf.HAS_TRITON, reason="needs triton")


def assert_close(got: torch.Tensor, expected: torch.Tensor, roundings: int) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    steps = roundings + (INTERPRETED and expected.dtype == torch.bfloat16)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=steps * STEP[expected.dtype])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(3, 48), (5, 100), (2, 4096)])
@pytest.mark.parametrize("with_add", [False, True])
def test_rms_norm_matches_torch(dtype, tokens, hidden, with_add):
    x = (torch.randn(tokens, hidden, device=DEVICE) * 3).to(dtype)
    add = torch.randn(tokens, hidden, device=DEVICE).to(dtype) if with_add else None
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    x_ref = x.clone()
    expected = ops._rms_norm_torch(x_ref, weight, 1e-5, add)
    got = tf.rms_norm(x, weight, 1e-5, add)
    # Rounded: the add (when there is one), the normalised row, its product with the weight.
    assert_close(got, expected, roundings=2 + with_add)
    assert_close(x, x_ref, roundings=1)  # the residual stream took the add in place (or is untouched)
    if not with_add:
        assert torch.equal(x, x_ref)


@needs_triton
def test_rms_norm_reads_rows_at_their_stride():
    """A row stride wider than the row (the first columns of a wider buffer); x updated in place there."""
    wide, add = torch.randn(4, 80, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    weight = torch.rand(48, device=DEVICE) + 0.5
    ref = wide.clone()
    expected = ops._rms_norm_torch(ref[:, :48], weight, 1e-6, add)
    got = tf.rms_norm(wide[:, :48], weight, 1e-6, add)
    assert_close(got, expected, roundings=0)
    assert_close(wide, ref, roundings=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [
    (5, 4, 2, 16), (3, 4, 2, 64), (2, 2, 1, 96), (3, 4, 2, 128),
    (2, 32, 8, 128),  # Llama-3-8B's heads: several tiles of heads per token, the last one partial
])
def test_rotary_matches_torch_on_the_q_and_k_heads_in_place(dtype, tokens, num_heads, num_kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 256, 500000.0, None, 256).to(DEVICE)
    cos_sin = rope.table(torch.randint(0, 256, (tokens,), device=DEVICE))
    heads = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    nqk = num_heads + num_kv_heads
    expected = heads.clone()
    ops._rotary_torch(expected[:, :nqk], cos_sin)
    qk = heads[:, :nqk]  # strided over tokens, as the model rotates q and k together
    assert tf.rotary_(qk, cos_sin) is qk
    assert_close(heads[:, :nqk], expected[:, :nqk], roundings=1)
    assert torch.equal(heads[:, nqk:], expected[:, nqk:])  # the v heads are left alone


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(3, 48), (4, 100), (2, 1408)])  # 1408: two programs per row
def test_silu_mul_matches_torch(dtype, tokens, inter):
    gate_up = (torch.randn(tokens, 2 * inter, device=DEVICE) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # no overflow in the sigmoid
    # torch rounds silu(gate) and the product; the kernel rounds once.
    assert_close(tf.silu_mul(gate_up), ops._silu_mul_torch(gate_up), roundings=2)


@needs_triton
def test_no_tokens_launch_nothing():
    x, weight = torch.empty(0, 48, device=DEVICE), torch.ones(48, device=DEVICE)
    assert tf.rms_norm(x, weight, 1e-5, torch.empty(0, 48, device=DEVICE)).shape == (0, 48)
    assert tf.silu_mul(torch.empty(0, 96, device=DEVICE)).shape == (0, 48)
    assert tf.rotary_(torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 8, device=DEVICE)).shape == (0, 4, 16)


# -- ops: which kernel runs ------------------------------------------------------------------------

def _refuse(*args, **kwargs):
    raise AssertionError("this kernel must not be chosen here")


@pytest.fixture
def no_triton(monkeypatch):
    for name in ("rms_norm", "rotary_", "silu_mul"):
        monkeypatch.setattr(tf, name, _refuse)


@pytest.fixture
def no_c_kernels(monkeypatch):
    for name in ("rms_norm", "rotary_", "silu_mul"):
        monkeypatch.setattr(cpu_kernels, name, _refuse)


def test_ops_take_the_torch_path_for_bf16_on_cpu(no_triton, no_c_kernels):
    """bf16 on CPU: neither C (fp32 only) nor Triton (CUDA only); the same values as the layers'
    torch code before `ops` took it over."""
    x, add = torch.randn(3, 40).bfloat16(), torch.randn(3, 40).bfloat16()
    weight = (torch.rand(40) + 0.5).bfloat16()
    h = x.clone()
    got = ops.rms_norm(h, weight, 1e-5, add)
    before = x + add
    xf = before.float()
    assert torch.equal(h, before)
    assert torch.equal(got, weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16))

    cos_sin = RotaryEmbedding(16, 64, 10000.0, None, 64).table(torch.tensor([0, 7, 63]))
    heads = torch.randn(3, 6, 16).bfloat16()
    x1, x2 = heads[:, :4].float().chunk(2, dim=-1)
    cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).bfloat16()
    assert torch.equal(ops.rotary_(heads[:, :4], cos_sin), rotated)

    gate_up = torch.randn(3, 64).bfloat16()
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:])


def test_ops_fp32_torch_path_takes_the_0_dim_scalars(no_triton, no_c_kernels, monkeypatch):
    """fp32 with the C kernels off: the norm on `RMSNorm`'s 0-dim eps and 1 / hidden, or made here."""
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    x, weight = torch.randn(3, 40), torch.rand(40) + 0.5
    expected = x * torch.addcmul(torch.tensor(1e-5), (x * x).sum(-1, keepdim=True), torch.tensor(1 / 40)).rsqrt() \
        * weight
    assert torch.equal(ops.rms_norm(x, weight, 1e-5, scalars=(torch.tensor(1e-5), torch.tensor(1 / 40))), expected)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), expected)


@pytest.mark.skipif(not cpu_kernels.usable(torch.zeros(1)), reason="the C kernels are not built here")
def test_ops_take_the_c_kernels_for_fp32_on_cpu(no_triton, monkeypatch):
    calls = []
    for name in ("rms_norm", "rotary_", "silu_mul"):
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    x, weight = torch.randn(3, 40), torch.rand(40) + 0.5
    assert_close(ops.rms_norm(x.clone(), weight, 1e-5), ops._rms_norm_torch(x.clone(), weight, 1e-5), 0)
    cos_sin = RotaryEmbedding(16, 64, 10000.0, None, 64).table(torch.tensor([0, 7, 63]))
    heads = torch.randn(3, 6, 16)
    assert_close(ops.rotary_(heads.clone()[:, :4], cos_sin), ops._rotary_torch(heads.clone()[:, :4], cos_sin), 0)
    gate_up = torch.randn(3, 64)
    assert_close(ops.silu_mul(gate_up), ops._silu_mul_torch(gate_up), 0)
    assert calls == ["rms_norm", "rotary_", "silu_mul"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not tf.HAS_TRITON, reason="needs a CUDA device and triton")
def test_ops_take_the_triton_kernels_on_a_gpu(no_c_kernels, monkeypatch):
    calls = []
    for name in ("rms_norm", "rotary_", "silu_mul"):
        kernel = getattr(tf, name)
        monkeypatch.setattr(tf, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    x = torch.randn(3, 40, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(x, torch.ones(40, device="cuda", dtype=torch.bfloat16), 1e-5)
    ops.rotary_(torch.randn(3, 6, 16, device="cuda")[:, :4], torch.randn(3, 2, 8, device="cuda"))
    ops.silu_mul(torch.randn(3, 64, device="cuda"))
    assert calls == ["rms_norm", "rotary_", "silu_mul"]
