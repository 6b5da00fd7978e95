"""A Triton GEMV for a one-token decode step (GPU path; on CPU it runs under `TRITON_INTERPRET=1`
for tests), with the small ops around a layer's weight GEMVs read in.

A batch-1 step of an 8B model on an H200 spent 3.96 of its 4.71 ms in cuBLAS's GEMVs, at 0.90
of the copy bandwidth; the rest was ~450 kernels of 1-4 us and the gaps between them (RESULTS.md,
#47, 53rd session). cuBLAS has no prologue or epilogue to take them; this kernel does:

- `gemv(x, w)`: `out[n] = sum_k x[k] * w[n, k]`, w `[N, K]` with rows contiguous, as the engine
  keeps a linear's weight on a GPU. One program per `block_n` rows, `block_k` columns a loop
  step, the products summed in fp32 and across once at the end. No split-K: every shape of a
  served model has enough rows for every SM.
- `norm=(weight, eps)`: x RMS-normalised and scaled by the norm's weight on the way in. The
  normalising factor rsqrt(mean(x^2) + eps) is one number, so it multiplies the sums at the end,
  and each program finds it from the x it reads anyway: the norm costs no kernel and no pass.
- `swiglu=True`: x holds gate then up (`[2K]`, as a gate_up projection writes them) and the
  input is silu(gate) * up: the down projection without a `silu_mul` kernel before it.
- `residual=True`: out += the product, in place (the residual stream), where the norm that
  follows would otherwise add it.
- `qkv_gemv`: the qkv projection with the norm read in, its rows taken in pairs (d, d + half) of
  a head, so that the q and k heads leave rotated (neox-style, as `rotary_`) and the k and v
  heads go to their cache slot too (as `write_kv`): a layer's attention input in one launch.

fp32, bf16 and fp16. Rounding differs from the op-by-op path (`ops.py`), which rounds the
normalised x, the SwiGLU product and the GEMV's output to the dtype before the next op; here they
stay fp32 until the one store. No host syncs: the launches are captured in the decode step's
CUDA graphs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from pdserve.engine.kernels.triton_paged import HAS_TRITON, _num_sms  # noqa: F401 - HAS_TRITON: callers read it here

# (rows a program computes, weights' columns a loop step reads, warps, pipeline stages); see `tiling`.
_WIDE, _NARROW = (16, 512, 4, 3), (8, 512, 4, 3)
_PROGRAMS_PER_SM = 2


def tiling(n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """The tiling of an `[n, k]` weight's GEMV: 16 rows a program, or 8 where 16 would leave fewer
    than `_PROGRAMS_PER_SM` programs an SM (an 8B model's o and down projections, 4,096 rows, on
    132 SMs). A function of the shape only, so each CUDA graph keeps its launch. (gpu_suite.py's
    gemv section times other tilings and cuBLAS; its dense section, the step on its fastest.)"""
    return _WIDE if n // _WIDE[0] >= _PROGRAMS_PER_SM * _num_sms(device) else _NARROW


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, out_ptr, norm_w_ptr, N, K, stride_w, eps, SWIGLU: tl.constexpr, NORM: tl.constexpr,
             RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across once, at the end
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # int64: an LM head's rows x K pass 2^31
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_ptr + K + cols, mask=cols < K, other=0.0).to(tl.float32)
                x = x / (1.0 + tl.exp(-x)) * up
            if NORM:
                squares += x * x
                x = x * tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if RESIDUAL:
            y += tl.load(out_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def qkv_gemv(x_ptr, w_ptr, out_ptr, norm_w_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, N, K, stride_w,
                 stride_cs, eps, Q_ROWS, KV_ROWS, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
        # The qkv projection of one token with the norm read in (as `gemv`'s NORM), computed in pairs
        # of rows (d, d + HALF) of a head, so that the q and k heads are rotated (neox-style) before
        # the store, and the k and v heads go to their cache slot as well.
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = pairs < N // 2
        d = pairs % HALF
        first = (pairs // HALF) * (2 * HALF) + d  # row d of its head; its partner is HALF rows on
        w_first = w_ptr + first.to(tl.int64)[:, None] * stride_w
        acc1 = tl.zeros((BLOCK_P, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_P, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            squares += x * x
            x = x * tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            mask = ok[:, None] & (cols[None, :] < K)
            acc1 += tl.load(w_first + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
            acc2 += tl.load(w_first + HALF * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
        scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        y1, y2 = tl.sum(acc1, axis=1) * scale, tl.sum(acc2, axis=1) * scale
        cos = tl.load(cs_ptr + d, mask=ok, other=1.0)
        sin = tl.load(cs_ptr + stride_cs + d, mask=ok, other=0.0)
        rotated = first < Q_ROWS + KV_ROWS  # q and k heads; v heads as they are
        o1 = tl.where(rotated, y1 * cos - y2 * sin, y1)
        o2 = tl.where(rotated, y2 * cos + y1 * sin, y2)
        tl.store(out_ptr + first, o1.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + first + HALF, o2.to(out_ptr.dtype.element_ty), mask=ok)
        # The cache's slots are dense: [slot, kv head, head_dim], KV_ROWS values a slot.
        slot = tl.load(slot_ptr)
        is_k = ok & (first >= Q_ROWS) & rotated
        is_v = ok & (first >= Q_ROWS + KV_ROWS)
        k_at = k_cache_ptr + slot * KV_ROWS + (first - Q_ROWS)
        v_at = v_cache_ptr + slot * KV_ROWS + (first - Q_ROWS - KV_ROWS)
        tl.store(k_at, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
        tl.store(k_at + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
        tl.store(v_at, o1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
        tl.store(v_at + HALF, o2.to(v_cache_ptr.dtype.element_ty), mask=is_v)

    return SimpleNamespace(gemv=gemv, qkv_gemv=qkv_gemv)


def gemv(x: torch.Tensor, w: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
         out: torch.Tensor | None = None, residual: bool = False,
         tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x `[K]` (`[2K]`, gate then up, with `swiglu`), contiguous; w `[N, K]` with `w.stride(1) == 1`
    -> out `[N]` (a new tensor of w's dtype unless given; with `residual`, added into `out`, which
    must not overlap x). `norm`: the norm's weight `[K]` and eps. `tile`: a tiling to use instead
    of `tiling`'s (the benchmark's sweep)."""
    n, k = w.shape
    if out is None:
        if residual:
            raise ValueError("residual=True adds into `out`: pass it")
        out = torch.empty(n, dtype=w.dtype, device=w.device)
    block_n, block_k, warps, stages = tile or tiling(n, k, w.device)
    norm_w, eps = norm if norm is not None else (x, 0.0)  # x: a pointer the kernel never reads
    _kernels().gemv[(-(-n // block_n),)](x, w, out, norm_w, n, k, w.stride(0), eps, SWIGLU=swiglu,
                                         NORM=norm is not None, RESIDUAL=residual, BLOCK_N=block_n,
                                         BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def qkv_gemv(x: torch.Tensor, w: torch.Tensor, norm: tuple[torch.Tensor, float], cos_sin: torch.Tensor,
             num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The qkv projection of one token in one launch: x `[K]` RMS-normalised by `norm` (weight,
    eps), times w `[(heads + 2 * kv_heads) * head_dim, K]` (q, then k, then v heads), the q and k
    heads rotated by cos_sin `[2, head_dim // 2]` (cos, then sin: neox-style, as `rotary_`), and
    k and v written to cache slot `slot[0]` of k_cache and v_cache (`[blocks, block_size, kv_heads,
    head_dim]`, contiguous, as `write_kv`). Returns the rotated q, k and v `[N]`."""
    n, k = w.shape
    _, _, kv_heads, head_dim = k_cache.shape
    if cos_sin.stride(-1) != 1 or 2 * cos_sin.shape[-1] != head_dim or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or n != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError("qkv_gemv: cos_sin [2, head_dim // 2] with rows contiguous, dense caches, and "
                         "(heads + 2 * kv_heads) * head_dim rows")
    out = torch.empty(n, dtype=w.dtype, device=w.device)
    block_n, block_k, warps, stages = tiling(n, k, w.device)
    _kernels().qkv_gemv[(-(-n // block_n),)](
        x, w, out, norm[0], cos_sin, k_cache, v_cache, slot, n, k, w.stride(0), cos_sin.stride(0), norm[1],
        num_heads * head_dim, kv_heads * head_dim, HALF=head_dim // 2, BLOCK_P=block_n // 2, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out
