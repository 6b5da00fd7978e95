"""gpu_suite.py's GEMV section: is a Triton GEMV a way to a batch-1 decode step at 0.8 of the
roofline?

A batch-1 step of the 8B shape on an H200 (RESULTS.md, #47, 53rd session) spends 3.96 of its
4.71 ms (replayed as a CUDA graph) in cuBLAS's weight GEMVs, at 0.90 of the copy bandwidth; the
rest is ~450 kernels of 1-4 us and the gaps between them. Two of a layer's four GEMVs run split-K
(a GEMV, then a reduction kernel: 64 kernels a step), and the small kernels around them (SwiGLU,
rotary, the K/V write) could run inside a GEMV of one's own, where cuBLAS has no such epilogue.
That is worth building only if a GEMV of our own streams the weights as fast as cuBLAS does. This
section measures it, before anything is built into the engine: for each of a layer's four weight
matrices at the model's shapes, cuBLAS (`torch.nn.functional.linear`, as the engine calls it) and a
Triton GEMV at a few tilings, each checked against cuBLAS and replayed in a CUDA graph; and the
down projection once more with SwiGLU read into its input (gate and up in, no `silu_mul` kernel
before it). Then a whole decoder layer at batch 1, as the engine runs it and on these GEMVs with
the two norms and the two residual adds read in as well (11-15 kernels a layer against 8), each
replayed in a CUDA graph: what a step would gain, measured before the engine is changed. Figures
only, no target: the next session decides from them.

On the CPU (the dry run) the kernel runs under Triton's interpreter at tiny shapes and is only
checked, not timed against anything that means something.
"""

from __future__ import annotations

import functools

import torch

# (rows a program computes, weights' columns a loop step reads, warps, pipeline stages).
TILINGS = ((8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 2), (32, 256, 8, 3))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, out_ptr, norm_w_ptr, N, K, stride_w, eps, SWIGLU: tl.constexpr, NORM: tl.constexpr,
             RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[n] = sum_k x[k] * w[n, k] for a block of n. With SWIGLU, x[k] = silu(g[k]) * u[k],
        # where x_ptr holds g then u (K each), as the gate_up projection writes them. With NORM,
        # x is RMS-normalised and scaled by norm_w first: the scale rsqrt(mean(x^2) + eps) is one
        # number, so it multiplies the sums at the end, and every program finds it from the x it
        # reads anyway. With RESIDUAL, out += the product (the residual stream, in place).
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across once, at the end
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_ptr + K + cols, mask=cols < K, other=0.0).to(tl.float32)
                x = x / (1.0 + tl.exp(-x)) * up
            if NORM:
                squares += x * x
                x = x * tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                        mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if RESIDUAL:
            y += tl.load(out_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)

    return gemv


def gemv(x: torch.Tensor, w: torch.Tensor, tiling: tuple[int, int, int, int], swiglu: bool = False,
         out: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
         residual: bool = False) -> torch.Tensor:
    """x `[K]` (`[2K]`, gate then up, with `swiglu`), w `[N, K]` (rows contiguous) -> `[N]`; with
    `norm` (weight `[K]`, eps), of x RMS-normalised; with `residual`, added into `out` (which must
    not be x)."""
    n, k = w.shape
    block_n, block_k, warps, stages = tiling
    out = torch.empty(n, dtype=w.dtype, device=w.device) if out is None else out
    norm_w, eps = norm if norm is not None else (x, 0.0)
    _kernel()[(-(-n // block_n),)](x, w, out, norm_w, n, k, w.stride(0), eps, SWIGLU=swiglu, NORM=norm is not None,
                                   RESIDUAL=residual, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                   num_stages=stages)
    return out


def run(rep, arch: dict, device: str, dtype: torch.dtype, iters: int, context: int) -> None:
    """The four GEMVs of a layer of `arch` (config.json) at batch 1, cuBLAS against the tilings;
    then a whole layer at a `context`-token sequence both ways (`_layer`)."""
    import torch.nn.functional as F

    from gpu_suite_sections import log, replay_seconds_per_call, seconds_per_call  # beside this script

    h, inter, hd = arch["hidden_size"], arch["intermediate_size"], arch["head_dim"]
    heads, kv_heads = arch["num_attention_heads"], arch["num_key_value_heads"]
    shapes = {"qkv": ((heads + 2 * kv_heads) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h),
              "down": (h, inter)}
    copy_bw = rep.limits.get("copy_bytes_per_s", 0) / 1e9
    g = torch.Generator(device=device).manual_seed(3)
    totals = {"cuBLAS": 0.0, "Triton, best tiling of each": 0.0}
    best_of: dict[str, tuple[int, int, int, int]] = {}

    how = "in a CUDA graph" if device.startswith("cuda") else "eager (the dry run)"

    def timed(fn) -> float:
        replayed = replay_seconds_per_call(fn, device, iters)
        if replayed is None and device.startswith("cuda"):
            raise RuntimeError("a GEMV could not be captured in a CUDA graph (see the log)")
        return replayed or seconds_per_call(fn, device, iters)

    for name, (n, k) in [*shapes.items(), ("down, SwiGLU read in", shapes["down"])]:
        swiglu = name.startswith("down, ")
        w = torch.randn(n, k, dtype=dtype, device=device, generator=g) * k ** -0.5
        x = torch.randn(2 * k if swiglu else k, dtype=dtype, device=device, generator=g)
        x_in = (F.silu(x[:k].float()) * x[k:].float()).to(dtype) if swiglu else x
        ref = F.linear(x_in[None], w)[0]
        cublas = timed(lambda w=w, x_in=x_in: F.linear(x_in[None], w)) if not swiglu else None
        best, found = None, {}
        for tiling in TILINGS:
            out = torch.empty(n, dtype=dtype, device=device)
            got = gemv(x, w, tiling, swiglu, out)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise AssertionError(f"Triton GEMV {name} {tiling} differs from cuBLAS: relative error {err:.2e}")
            found[tiling] = timed(lambda x=x, w=w, tiling=tiling, swiglu=swiglu, out=out:
                                  gemv(x, w, tiling, swiglu, out))
            best = tiling if best is None or found[tiling] < found[best] else best
        best_of[name] = best
        nbytes = n * k * w.element_size()
        rep.figures("gemv", **{f"{name}_shape": [n, k], f"{name}_cublas_s": cublas,
                               f"{name}_triton_s": {str(t): s for t, s in found.items()}})
        if cublas is not None:
            totals["cuBLAS"] += cublas
            totals["Triton, best tiling of each"] += found[best]
            rep.row("gemv", f"batch-1 GEMV {name} ({n}x{k}), cuBLAS, weight bytes read", nbytes / cublas / 1e9,
                    "GB/s", copy_bw, "copy bandwidth", None, note=f"{cublas * 1e6:.1f} us {how}")
        rep.row("gemv", f"batch-1 GEMV {name} ({n}x{k}), Triton, best of {len(TILINGS)} tilings {best}, "
                "weight bytes read", nbytes / found[best] / 1e9, "GB/s", copy_bw, "copy bandwidth", None,
                note=f"{found[best] * 1e6:.1f} us {how}" + (
                    f"; cuBLAS {cublas * 1e6:.1f} us" if cublas else
                    "; against cuBLAS's down GEMV above and the silu_mul kernel before it"))
    log("gemv: a layer's four GEMVs, " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in totals.items()))
    rep.figures("gemv", layer_s=totals)
    _layer(rep, arch, device, dtype, iters, context, best_of, timed, how)


def _layer(rep, arch: dict, device: str, dtype: torch.dtype, iters: int, context: int,
           best_of: dict[str, tuple[int, int, int, int]], timed, how: str) -> None:
    """A decoder layer's batch-1 decode step, both ways, on the same weights and cache:
    - as the engine runs it (models/llama.py): norm (with the residual add), cuBLAS's qkv GEMV,
      rotary, the K/V write, paged attention, cuBLAS's o GEMV, norm (with the residual add),
      cuBLAS's gate_up GEMV, silu_mul, cuBLAS's down GEMV (its output added in the next norm);
    - on the Triton GEMV: each norm read into the GEMV after it, SwiGLU into the down GEMV, and
      the o and down GEMVs adding into the residual stream: four kernels fewer, and none of
      cuBLAS's split-K reductions.
    Checked against each other (the residual stream after the layer), then each replayed in a
    CUDA graph: the difference, times the layers, is what a step would gain."""
    import math

    import torch.nn.functional as F

    from pdserve.engine.kernels import ops, triton_paged

    h, inter, hd = arch["hidden_size"], arch["intermediate_size"], arch["head_dim"]
    nq, nkv, eps = arch["num_attention_heads"], arch["num_key_value_heads"], arch["rms_norm_eps"]
    g = torch.Generator(device=device).manual_seed(4)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, dtype=dtype, device=device, generator=g) * scale

    w_qkv, w_o = randn((nq + 2 * nkv) * hd, h, scale=h ** -0.5), randn(h, nq * hd, scale=(nq * hd) ** -0.5)
    w_gate_up, w_down = randn(2 * inter, h, scale=h ** -0.5), randn(h, inter, scale=inter ** -0.5)
    ln1, ln2 = 1 + randn(h, scale=0.1), 1 + randn(h, scale=0.1)
    block = 16
    k_cache, v_cache = randn(context // block + 1, block, nkv, hd), randn(context // block + 1, block, nkv, hd)
    tables = torch.arange(context // block + 1, device=device)[None]
    lens = torch.tensor([context], device=device)
    slot = torch.tensor([context - 1], device=device)
    angle = torch.rand(1, hd // 2, device=device, generator=g) * 2 * math.pi
    cos_sin = torch.stack((angle.cos(), angle.sin()), dim=1)  # [1, 2, hd // 2], fp32
    scale = hd ** -0.5

    def attention(qkv: torch.Tensor) -> torch.Tensor:
        heads = qkv.view(1, -1, hd)
        ops.rotary_(heads[:, :nq + nkv], cos_sin)
        ops.write_kv(heads[:, nq:nq + nkv], heads[:, nq + nkv:], k_cache, v_cache, slot)
        return triton_paged.paged_decode_attention(heads[:, :nq], k_cache, v_cache, tables, lens, scale).view(1, -1)

    def engine_layer(stream: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        x = ops.rms_norm(stream, ln1, eps, add=pending)
        x = ops.rms_norm(stream, ln2, eps, add=F.linear(attention(F.linear(x, w_qkv)), w_o))
        return F.linear(ops.silu_mul(F.linear(x, w_gate_up)), w_down)

    qkv, gate_up = torch.empty((nq + 2 * nkv) * hd, dtype=dtype, device=device), torch.empty(2 * inter, dtype=dtype,
                                                                                             device=device)

    def triton_layer(stream: torch.Tensor) -> None:
        gemv(stream[0], w_qkv, best_of["qkv"], out=qkv, norm=(ln1, eps))
        gemv(attention(qkv)[0], w_o, best_of["o"], out=stream[0], residual=True)
        gemv(stream[0], w_gate_up, best_of["gate_up"], out=gate_up, norm=(ln2, eps))
        gemv(gate_up, w_down, best_of["down, SwiGLU read in"], swiglu=True, out=stream[0], residual=True)

    start = randn(1, h)
    ours, theirs = start.clone(), start.clone()
    theirs += engine_layer(theirs, None)  # the next layer's norm would add it
    triton_layer(ours)
    err = ((ours.float() - theirs.float()).norm() / (theirs.float() - start.float()).norm()).item()
    if not err < 3e-2:
        raise AssertionError(f"the layer on Triton GEMVs differs from the engine's: relative error {err:.2e}")
    stream, pending = start.clone(), engine_layer(start.clone(), None)
    engine_s = timed(lambda: engine_layer(stream, pending))
    triton_s = timed(lambda: triton_layer(stream))
    layers = arch["num_hidden_layers"]
    rep.figures("gemv", layer_relative_error=err, layer_context=context, layer_engine_s=engine_s,
                layer_triton_s=triton_s)
    rep.row("gemv", f"batch-1 decoder layer at context {context}, as the engine runs it (cuBLAS) / on Triton "
            "GEMVs with the norms, SwiGLU and residual adds read in", engine_s / triton_s, "x", 1.0,
            "the engine's layer", None,
            note=f"{engine_s * 1e6:.1f} against {triton_s * 1e6:.1f} us {how}; times {layers} layers, "
                 f"{(engine_s - triton_s) * layers * 1e3:+.3f} ms a step; relative error {err:.1e}")
