"""Triton kernels for a routed mixture of SwiGLU experts, in the manner of vLLM's `fused_moe` (GPU
path; on CPU they run under `TRITON_INTERPRET=1` for tests). The loop over experts in
`models/mixtral.py` stays the reference.

`fused_moe(x, w13, w2, top_w, top_i)`: tokens `x [T, hidden]`, each routed to `top_i [T, K]` with
weights `top_w [T, K]`; experts in the checkpoint's `[out, in]` layout, `w13 [E, 2*I, hidden]`
(gate rows, then up rows) and `w2 [E, hidden, I]`, so a tile of weights is read along contiguous
rows. Returns `sum_k top_w[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t]))`, `e = top_i[t, k]`.

How, with no host sync and sizes that depend only on shapes (CUDA graphs capture it):
1. Alignment (`align_by_expert`): the T*K (token, slot) pairs, numbered `pair = token*K + slot`,
   ordered by expert, each expert's run padded to a multiple of BLOCK_M rows, into a buffer of the
   worst-case size `T*K + min(E, T*K)*(BLOCK_M-1)`; padding rows hold the sentinel `T*K`. Also each
   block's expert and the number of rows used, on the device. One Triton program does it for
   decode-sized batches (one launch); larger batches use torch's sort, scatter and searchsorted.
2. A grouped GEMM, one program per (block of BLOCK_M rows, BLOCK_N outputs): the rows' inputs
   times one expert's weights, so each tile of weights is read once per block. Blocks past the
   used rows return at once. First `h = silu(x @ w1[e]^T) * (x @ w3[e]^T)` (gate and up tiles in
   one program, the SwiGLU in its epilogue), then `y = top_w * (h @ w2[e]^T)` into `[T, K, hidden]`.
3. `y.sum(1)`: the slots of each token summed in a fixed order (deterministic, unlike atomics).

It does not know about tensor or expert parallelism: the caller all-reduces.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

# Triton imported on first use, as there (HAS_TRITON says whether it is installed).
from pdserve.engine.kernels.triton_paged import HAS_TRITON  # noqa: F401 - callers read it here
from pdserve.engine.kernels.triton_paged import _num_sms, _pow2


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def _align_kernel(top_i_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, num_pairs, num_experts, num_slots,
                      BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        # One program: a pair's place is its expert's padded start plus the number of earlier
        # pairs with that expert (stable), counted CHUNK pairs at a time as [CHUNK, EXPERTS] one-hots.
        e_ids = tl.arange(0, EXPERTS)
        c = tl.arange(0, CHUNK)
        counts = tl.zeros([EXPERTS], tl.int32)
        for start in range(0, num_pairs, CHUNK):
            p = start + c
            e = tl.load(top_i_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)  # -1: no expert
            counts += tl.sum((e[:, None] == e_ids[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        padded_start = padded_end - padded
        tl.store(num_rows_ptr, tl.sum(padded, axis=0))
        for start in range(0, num_slots, CHUNK):
            r = start + c
            # A row inside some expert's pairs is written below; the others are padding.
            inside = (r[:, None] >= padded_start[None, :]) & (r[:, None] < (padded_start + counts)[None, :])
            is_pad = tl.sum(inside.to(tl.int32), axis=1) == 0
            tl.store(sorted_ptr + r, num_pairs, mask=(r < num_slots) & is_pad)
        for start in range(0, num_slots // BLOCK_M, CHUNK):
            # A block's expert: the number of experts whose runs end at or before its first row
            # (the last expert for the unused blocks past them, which no program reads).
            b = start + c
            expert = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.minimum(expert, num_experts - 1), mask=b < num_slots // BLOCK_M)
        next_row = padded_start
        for start in range(0, num_pairs, CHUNK):
            p = start + c
            e = tl.load(top_i_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
            hit = (e[:, None] == e_ids[None, :]).to(tl.int32)
            before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of this chunk with the same expert
            row = tl.sum(hit * (next_row[None, :] + before), axis=1)
            tl.store(sorted_ptr + row, p, mask=p < num_pairs)
            next_row += tl.sum(hit, axis=0)

    @triton.jit
    def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, top_w_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                            num_pairs, N, K, stride_a, stride_we, stride_wn, stride_out,
                            PAIRS_PER_A_ROW: tl.constexpr, SWIGLU: tl.constexpr, MUL_TOP_W: tl.constexpr,
                            DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        # out[pair, n] = A[pair // PAIRS_PER_A_ROW] . W[expert, n, :] over this block's pairs; with
        # SWIGLU, silu(that) * the same with W's row N + n (gate and up).
        tile_n = tl.program_id(0)
        block = tl.program_id(1)
        if block * BLOCK_M >= tl.load(num_rows_ptr):
            return
        pair = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        pair_ok = pair < num_pairs  # padding rows hold the sentinel num_pairs
        a_row = pair // PAIRS_PER_A_ROW
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # rows along K: contiguous
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            a = tl.load(a_ptr + a_row[:, None] * stride_a + k[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_rows + k[:, None], mask=w_ok, other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            # "ieee": fp32 inputs must not drop to TF32 on a GPU (bf16/fp16 are unaffected).
            acc += tl.dot(a, w, input_precision="ieee")
            if SWIGLU:
                w_up = tl.load(w_rows + N * stride_wn + k[:, None], mask=w_ok, other=0.0)
                if DOT_FP32:
                    w_up = w_up.to(tl.float32)
                acc_up += tl.dot(a, w_up, input_precision="ieee")
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        if MUL_TOP_W:
            acc = acc * tl.load(top_w_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pair[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=pair_ok[:, None] & n_ok[None, :])

    return SimpleNamespace(align=_align_kernel, expert_gemm=_expert_gemm_kernel)


# Alignment in one Triton program up to this many pairs (128 tokens at top-8: decode batches); it
# runs serially over them, so larger batches take torch's parallel sort instead.
_ONE_PROGRAM_ALIGN_MAX_PAIRS = 1024
_ALIGN_CHUNK = 64


def num_aligned_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned buffer: every used expert's run padded to a multiple of `block_m` fits
    (at most min(E, pairs) experts are used, each padded by under `block_m`), rounded to blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_by_expert(top_i: torch.Tensor, num_experts: int, block_m: int,
                    use_torch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_i [T, K]` -> (`sorted_ids` int32 `[num_aligned_rows]`: pair ids grouped by expert, each run
    padded to `block_m` with the sentinel T*K; `block_expert` int32 `[num_aligned_rows // block_m]`:
    each block's expert, meaningful for the used blocks; `num_rows` int32 `[1]`: rows used, on the
    device). `use_torch` picks the path (tests); by default the batch's size does."""
    num_pairs = top_i.numel()
    num_slots = num_aligned_rows(num_pairs, num_experts, block_m)
    if use_torch is None:
        use_torch = num_pairs > _ONE_PROGRAM_ALIGN_MAX_PAIRS
    if use_torch:
        return _align_with_torch(top_i.flatten(), num_experts, block_m, num_slots)
    device = top_i.device
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_slots // block_m, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    _kernels().align[(1,)](top_i.contiguous(), sorted_ids, block_expert, num_rows, num_pairs, num_experts,
                           num_slots, BLOCK_M=block_m, EXPERTS=_pow2(num_experts), CHUNK=_ALIGN_CHUNK,
                           num_warps=8)
    return sorted_ids, block_expert, num_rows


def _align_with_torch(experts: torch.Tensor, num_experts: int, block_m: int,
                      num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Not bincount: on CUDA it reads the largest id on the host to size its output.
    num_pairs = experts.numel()
    sorted_experts, order = torch.sort(experts, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # The j-th pair in expert order moves down by its expert's padding so far.
    shift = (padded_end - padded) - (counts.cumsum(0) - counts)
    rows = torch.arange(num_pairs, device=experts.device) + shift[sorted_experts]
    sorted_ids = torch.full((num_slots,), num_pairs, dtype=torch.int32, device=experts.device)
    sorted_ids.scatter_(0, rows, order.to(torch.int32))
    first_rows = torch.arange(0, num_slots, block_m, device=experts.device)
    block_expert = torch.searchsorted(padded_end, first_rows, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (the tensor-core minimum) while experts get few pairs each (decode), so
    little of a tile is padding; more as they get many (prefill), so weights are re-read less."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def choose_block_n(n: int, num_pairs: int, num_experts: int, num_sms: int) -> int:
    """Outputs per program: 64, or fewer (at least 16) while a launch would have under two programs
    an SM. At decode batches each chosen expert gets one block of a row or two: with 64-wide tiles a
    batch-1 step of Qwen3-30B-A3B's shapes launched 96 programs on an H200's 132 SMs, and the MoE
    block read its 76 MB at 0.28 of the copy bandwidth (RESULTS.md, #47, 53rd session). A function
    of shapes only: each CUDA graph's batch keeps its own."""
    blocks = min(num_experts, num_pairs)  # at least one block for each expert a pair chose
    block_n = min(64, max(16, _pow2(n)))
    while block_n > 16 and -(-n // block_n) * blocks < 2 * num_sms:
        block_n //= 2
    return block_n


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, top_w: torch.Tensor,
                 alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int, num_pairs: int,
                 pairs_per_a_row: int, swiglu: bool, block_n: int | None) -> None:
    sorted_ids, block_expert, num_rows = alignment
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    k = w.shape[2]
    block_n = block_n or choose_block_n(n, num_pairs, w.shape[0], _num_sms(a.device))
    block_k = min(128 if a.element_size() <= 2 else 64, max(16, _pow2(k)))  # fp32: half, for shared memory
    grid = (-(-n // block_n), block_expert.numel())
    _kernels().expert_gemm[grid](
        a, w, out, top_w, sorted_ids, block_expert, num_rows, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row, SWIGLU=swiglu, MUL_TOP_W=not swiglu,
        # The interpreter's tl.dot multiplies bf16 bit patterns (it has no bf16 arithmetic): products
        # in fp32 there, which the GPU's bf16 tensor cores also accumulate in.
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1" and a.element_size() < 4,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
              block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """`[T, hidden]` (see the module docstring). `block_m` and `block_n` override the rows per block
    and the outputs per program (tests, benchmarks)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = top_i.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and w2.shape == (num_experts, hidden, two_i // 2)
    block_m = block_m or choose_block_m(num_pairs, num_experts)
    alignment = align_by_expert(top_i, num_experts, block_m)
    top_w = top_w.contiguous()
    h = x.new_empty(num_pairs, two_i // 2)
    y = x.new_empty(num_tokens, top_k, hidden)
    _expert_gemm(x.contiguous(), w13, h, top_w, alignment, block_m, num_pairs, top_k, True, block_n)
    _expert_gemm(h, w2, y.view(num_pairs, hidden), top_w, alignment, block_m, num_pairs, 1, False, block_n)
    return y.sum(1)
