"""gpu_suite.py's GEMV section: does the engine's own GEMV (`engine/kernels/triton_gemv.py`) bring a
batch-1 decode step to 0.8 of the roofline?

A batch-1 step of the 8B shape on an H200 (RESULTS.md, #47, 53rd session) spent 3.96 of its
4.71 ms (replayed as a CUDA graph) in cuBLAS's weight GEMVs, at 0.90 of the copy bandwidth; the
rest was ~450 kernels of 1-4 us and the gaps between them. Two of a layer's four GEMVs ran split-K
(a GEMV, then a reduction kernel: 64 kernels a step), and the small kernels around them (the
norms, SwiGLU, the residual adds) can run inside a GEMV of one's own, where cuBLAS has no such
prologue or epilogue. That pays only if the GEMV streams the weights about as fast as cuBLAS.
This section measures it: for each of a layer's four weight matrices at the model's shapes,
cuBLAS (`torch.nn.functional.linear`, as the engine calls it for steps of several tokens) and the
Triton GEMV at a few tilings, the engine's rule's among them, each checked against cuBLAS and
replayed in a CUDA graph; the down projection once more with SwiGLU read into its input. Then a
whole decoder layer at batch 1, op by op and as the engine runs a one-token step (`_layer`).
Figures only, no target (the dense section's batch-1 rows carry it).

On the CPU (the dry run) the kernel runs under Triton's interpreter at tiny shapes and is only
checked, not timed against anything that means something.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels.triton_gemv import gemv, qkv_gemv, tiling

# (rows a program computes, weights' columns a loop step reads, warps, pipeline stages); the
# engine's rule (`triton_gemv.tiling`) picks one of the first three.
TILINGS = ((8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 2), (32, 256, 8, 3))


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
    totals = {"cuBLAS": 0.0, "Triton, best tiling of each": 0.0, "Triton, the engine's tiling": 0.0}
    fastest: dict[str, list[int]] = {}  # "NxK" -> the fastest tiling (the dense section runs a step on them)

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
        for tile in TILINGS:
            out = torch.empty(n, dtype=dtype, device=device)
            got = gemv(x, w, swiglu=swiglu, out=out, tile=tile)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise AssertionError(f"Triton GEMV {name} {tile} differs from cuBLAS: relative error {err:.2e}")
            found[tile] = timed(lambda x=x, w=w, tile=tile, swiglu=swiglu, out=out:
                                gemv(x, w, swiglu=swiglu, out=out, tile=tile))
            best = tile if best is None or found[tile] < found[best] else best
        rule = tiling(n, k, w.device)
        fastest[f"{n}x{k}"] = list(best)  # the SwiGLU down's, last, is the engine's down
        nbytes = n * k * w.element_size()
        rep.figures("gemv", **{f"{name}_shape": [n, k], f"{name}_cublas_s": cublas,
                               f"{name}_gemv_s": {str(t): s for t, s in found.items()}})
        if cublas is not None:
            totals["cuBLAS"] += cublas
            totals["Triton, best tiling of each"] += found[best]
            totals["Triton, the engine's tiling"] += found[rule]
            rep.row("gemv", f"batch-1 GEMV {name} ({n}x{k}), cuBLAS, weight bytes read", nbytes / cublas / 1e9,
                    "GB/s", copy_bw, "copy bandwidth", None, note=f"{cublas * 1e6:.1f} us {how}")
        rep.row("gemv", f"batch-1 GEMV {name} ({n}x{k}), Triton, best of {len(TILINGS)} tilings {best}, "
                "weight bytes read", nbytes / found[best] / 1e9, "GB/s", copy_bw, "copy bandwidth", None,
                note=f"{found[best] * 1e6:.1f} us {how}; the engine's tiling {rule} {found[rule] * 1e6:.1f} us" + (
                    f"; cuBLAS {cublas * 1e6:.1f} us" if cublas else
                    "; against cuBLAS's down GEMV above and the silu_mul kernel before it"))
    log("gemv: a layer's four GEMVs, " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in totals.items()))
    rep.figures("gemv", layer_s=totals, fastest_tiling_by_shape=fastest)
    _layer(rep, arch, device, dtype, context, timed, how)


def _layer(rep, arch: dict, device: str, dtype: torch.dtype, context: int, timed, how: str) -> None:
    """A decoder layer's batch-1 decode step, both ways, on the same weights and cache:
    - op by op, as the engine runs a step of several tokens (models/llama.py): norm (with the
      residual add), cuBLAS's qkv GEMV, rotary, the K/V write, paged attention, cuBLAS's o GEMV,
      norm (with the residual add), cuBLAS's gate_up GEMV, silu_mul, cuBLAS's down GEMV (its
      output added in the next norm);
    - as the engine runs a one-token step on a GPU (`triton_gemv`): each norm read into the GEMV
      after it, rotary and the K/V write into the qkv GEMV, SwiGLU into the down GEMV, and the o
      and down GEMVs adding into the residual stream: 6 kernels a layer against 11-15 (cuBLAS
      splits some GEMVs in two: a reduction kernel after).
    Checked against each other (the residual stream after the layer), then each replayed in a
    CUDA graph: the difference, times the layers, is what a step gains."""
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

    def attention(qkv: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        heads = qkv.view(1, -1, hd)
        if not kv_written:
            ops.rotary_(heads[:, :nq + nkv], cos_sin)
            ops.write_kv(heads[:, nq:nq + nkv], heads[:, nq + nkv:], k_cache, v_cache, slot)
        return triton_paged.paged_decode_attention(heads[:, :nq], k_cache, v_cache, tables, lens, scale).view(1, -1)

    def op_by_op_layer(stream: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        x = ops.rms_norm(stream, ln1, eps, add=pending)
        x = ops.rms_norm(stream, ln2, eps, add=F.linear(attention(F.linear(x, w_qkv)), w_o))
        return F.linear(ops.silu_mul(F.linear(x, w_gate_up)), w_down)

    gate_up = torch.empty(2 * inter, dtype=dtype, device=device)

    def gemv_layer(stream: torch.Tensor) -> None:
        qkv = qkv_gemv(stream[0], w_qkv, (ln1, eps), cos_sin[0], nq, k_cache, v_cache, slot)
        gemv(attention(qkv, kv_written=True)[0], w_o, out=stream[0], residual=True)
        gemv(stream[0], w_gate_up, norm=(ln2, eps), out=gate_up)
        gemv(gate_up, w_down, swiglu=True, out=stream[0], residual=True)

    start = randn(1, h)
    ours, theirs = start.clone(), start.clone()
    theirs += op_by_op_layer(theirs, None)  # the next layer's norm would add it
    gemv_layer(ours)
    err = ((ours.float() - theirs.float()).norm() / (theirs.float() - start.float()).norm()).item()
    if not err < 3e-2:
        raise AssertionError(f"the layer on Triton GEMVs differs from the op-by-op one: relative error {err:.2e}")
    stream, pending = start.clone(), op_by_op_layer(start.clone(), None)
    op_by_op_s = timed(lambda: op_by_op_layer(stream, pending))
    gemv_s = timed(lambda: gemv_layer(stream))
    layers = arch["num_hidden_layers"]
    rep.figures("gemv", layer_relative_error=err, layer_context=context, layer_op_by_op_s=op_by_op_s,
                layer_gemvs_s=gemv_s)
    rep.row("gemv", f"batch-1 decoder layer at context {context}, op by op (cuBLAS) / on Triton GEMVs with "
            "the norms, rotary, the K/V write, SwiGLU and residual adds read in", op_by_op_s / gemv_s, "x", 1.0, "op by op", None,
            note=f"{op_by_op_s * 1e6:.1f} against {gemv_s * 1e6:.1f} us {how}; times {layers} layers, "
                 f"{(op_by_op_s - gemv_s) * layers * 1e3:+.3f} ms a step; relative error {err:.1e}")
