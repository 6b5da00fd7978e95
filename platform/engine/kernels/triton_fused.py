"""Fused Triton kernels for a decoder layer's elementwise ops (GPU path; on CPU they run under
`TRITON_INTERPRET=1` for tests). Torch runs each of these as several kernels of 1-3 us at decode
batch sizes (about a quarter of an 8B model's batch-1 step on an H100); here each is one launch.
Same semantics as the torch path in `ops.py`, which stays the reference:

- `rms_norm(x, weight, eps, add)`: x `[tokens, hidden]`; with `add`, x += add first, in place
  (the sum rounded to x's dtype and stored), then `weight * (x * rsqrt(mean(x^2) + eps))`,
  normalised in fp32, cast to x's dtype, then scaled by the weight (rounded once more). One
  program per row, the whole row in registers.
- `rotary_(x, cos_sin)`: neox-style (rotate halves) in place on x `[tokens, heads, head_dim]`,
  heads dense within a token, tokens at any stride (the q and k heads of a qkv projection);
  cos_sin `[tokens, 2, head_dim // 2]`. One program per (token, tile of heads); fp32 math.
- `silu_mul(gate_up)`: `[tokens, 2 * inter]` (gate, then up) -> `silu(gate) * up`
  `[tokens, inter]`, in fp32, rounded once (torch rounds silu(gate) before the product).

fp32, bf16 and fp16 inputs. No host syncs and no data-dependent allocations: the launches are
captured in the decode step's CUDA graphs. The callers (`ops.py`) check the layouts above.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

# Triton imported on first use, as there (HAS_TRITON says whether it is installed).
from pdserve.engine.kernels.triton_paged import HAS_TRITON, _pow2  # noqa: F401 - HAS_TRITON: callers read it here

# Elements of each half a rotary program rotates (its tile of heads times head_dim // 2), and of
# the output a silu_mul program writes: a few per thread at 4 warps.
_ROTARY_TILE = 1024
_SILU_MUL_BLOCK = 1024


def _row_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` elements: 8-16 per thread."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, add_ptr, w_ptr, out_ptr, stride_x, stride_add, stride_out, hidden, eps,
                         HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64: offsets into a long prefill overflow 32 bits
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x_row = x_ptr + row * stride_x + cols
        x = tl.load(x_row, mask=ok, other=0.0)
        if HAS_ADD:
            # As torch's `x += add`: the sum in fp32, rounded to x's dtype, is the residual stream.
            x = (x.to(tl.float32) + tl.load(add_ptr + row * stride_add + cols, mask=ok, other=0.0).to(tl.float32))
            x = x.to(x_ptr.dtype.element_ty)
            tl.store(x_row, x, mask=ok)
        xf = x.to(tl.float32)
        normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference does
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(x_ptr, cs_ptr, stride_xt, stride_cst, stride_csk, heads,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = (h[:, None] < heads) & (d[None, :] < HALF)
        cs = cs_ptr + token * stride_cst + d
        cos = tl.load(cs, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(cs + stride_csk, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        first = x_ptr + token * stride_xt + h[:, None] * (2 * HALF) + d[None, :]  # heads dense: stride head_dim
        x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
        tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
        tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
        e = tl.exp(-tl.abs(gate))  # the sigmoid without overflow on either side
        out = gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(rms_norm=_rms_norm_kernel, rotary=_rotary_kernel, silu_mul=_silu_mul_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None) -> torch.Tensor:
    """x `[tokens, hidden]` (`x.stride(1) == 1`), weight `[hidden]` of x's dtype -> a new
    `[tokens, hidden]`; with `add` (x's shape), x += add first, in place."""
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    if tokens:
        block = _pow2(hidden)
        _kernels().rms_norm[(tokens,)](
            x, x if add is None else add, weight, out, x.stride(0), 0 if add is None else add.stride(0),
            out.stride(0), hidden, eps, HAS_ADD=add is not None, BLOCK=block, num_warps=_row_warps(block))
    return out


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]` in place (heads dense: `x.stride(1) == head_dim`,
    `x.stride(2) == 1`; tokens at any stride) by cos_sin `[tokens, 2, head_dim // 2]` with
    `cos_sin.stride(2) == 1`; returns x."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    block_d = _pow2(half)
    block_h = min(_pow2(heads), max(1, _ROTARY_TILE // block_d))
    if tokens:
        _kernels().rotary[(tokens, -(-heads // block_h))](
            x, cos_sin, x.stride(0), cos_sin.stride(0), cos_sin.stride(1), heads,
            HALF=half, BLOCK_H=block_h, BLOCK_D=block_d)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[tokens, 2 * inter]` (`gate_up.stride(1) == 1`) -> `silu(gate) * up` `[tokens, inter]`."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_SILU_MUL_BLOCK, _pow2(inter))
    if tokens:
        _kernels().silu_mul[(tokens, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                          BLOCK=block)
    return out
