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
before it). Figures only, no target: the next session decides from them.

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
    def gemv(x_ptr, w_ptr, out_ptr, N, K, stride_w, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
        # out[n] = sum_k x[k] * w[n, k] for a block of n; with SWIGLU, x[k] = silu(g[k]) * u[k]
        # where x_ptr holds g then u (K each), as the gate_up projection writes them.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across once, at the end
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_ptr + K + cols, mask=cols < K, other=0.0).to(tl.float32)
                x = x / (1.0 + tl.exp(-x)) * up
            w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                        mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)

    return gemv


def gemv(x: torch.Tensor, w: torch.Tensor, tiling: tuple[int, int, int, int], swiglu: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[K]` (`[2K]`, gate then up, with `swiglu`), w `[N, K]` (rows contiguous) -> `[N]`."""
    n, k = w.shape
    block_n, block_k, warps, stages = tiling
    out = torch.empty(n, dtype=w.dtype, device=w.device) if out is None else out
    _kernel()[(-(-n // block_n),)](x, w, out, n, k, w.stride(0), SWIGLU=swiglu, BLOCK_N=block_n,
                                   BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def run(rep, arch: dict, device: str, dtype: torch.dtype, iters: int) -> None:
    """The four GEMVs of a layer of `arch` (config.json) at batch 1, cuBLAS against the tilings."""
    import torch.nn.functional as F

    from gpu_suite_sections import log, replay_seconds_per_call, seconds_per_call  # beside this script

    h, inter, hd = arch["hidden_size"], arch["intermediate_size"], arch["head_dim"]
    heads, kv_heads = arch["num_attention_heads"], arch["num_key_value_heads"]
    shapes = {"qkv": ((heads + 2 * kv_heads) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h),
              "down": (h, inter)}
    copy_bw = rep.limits.get("copy_bytes_per_s", 0) / 1e9
    g = torch.Generator(device=device).manual_seed(3)
    totals = {"cuBLAS": 0.0, "Triton, best tiling of each": 0.0}

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
