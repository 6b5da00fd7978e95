"""The linear layers' matmul on CPU: pdserve's packed kernel (`cpu_kernels.linear`), on fp32 panels
and on bf16 ones (`weight_dtype: bfloat16`), against oneDNN's packed matmul (what the engine used
before) and MKL's `F.linear` on the plain weight, on the benchmark model's shapes, at the row
counts a decode step (1-64) and a prefill chunk (256-2048) bring. All four in the same run,
interleaved per shape.

    python benchmarks/cpu_linear.py [--rows 1,4,16,64,256,2048]

Weights are cycled over enough copies to exceed the last-level cache at small row counts, so
they stream from memory as in a decode step. Prints a markdown table (time per model step: the
eight layers' four matrices plus the LM head) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels

# bench-llama-56m: qkv, o, gate_up, down (x 8 layers) and the LM head, as (out, in)
SHAPES = [((1024, 512), 8), ((512, 512), 8), ((2816, 512), 8), ((512, 1408), 8), ((32000, 512), 1)]


def median_seconds(f, repeats: int) -> float:
    """Median wall time of f() over `repeats` calls, after two warm-up calls."""
    for _ in range(2):
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(rows: int, repeats: int) -> dict:
    step = {"pdserve": 0.0, "pdserve bf16": 0.0, "onednn": 0.0, "mkl": 0.0}
    per_shape = []
    for (n, k), count in SHAPES:
        copies = max(2, 128_000_000 // (n * k * 4)) if rows <= 16 else 1  # > L3 (32 MiB) in bf16 too
        ws = [torch.randn(n, k) for _ in range(copies)]
        packed = [cpu_kernels.pack_linear(w) for w in ws]
        packed_bf16 = [cpu_kernels.pack_linear(w, dtype=torch.bfloat16) for w in ws]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
        x = torch.randn(rows, k)
        torch.testing.assert_close(cpu_kernels.linear(x, packed[0], n, None), F.linear(x, ws[0]),
                                   atol=1e-3, rtol=1e-3)
        turn = [0]

        def cycling(fn, items):
            def call():
                turn[0] = (turn[0] + 1) % len(items)
                fn(items[turn[0]])
            return call

        times = {
            "pdserve": median_seconds(cycling(lambda p: cpu_kernels.linear(x, p, n, None), packed), repeats),
            "pdserve bf16": median_seconds(cycling(lambda p: cpu_kernels.linear(x, p, n, None), packed_bf16), repeats),
            "onednn": median_seconds(cycling(lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                                        onednn), repeats),
            "mkl": median_seconds(cycling(lambda w: F.linear(x, w), ws), repeats),
        }
        for name, t in times.items():
            step[name] += t * count
        per_shape.append({"shape": [n, k], "gflop_s": {name: 2 * rows * n * k / t / 1e9 for name, t in times.items()}})
    return {"rows": rows, "step_ms": {name: t * 1e3 for name, t in step.items()}, "per_shape": per_shape}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,256,2048", help="row counts (tokens in a step)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if cpu_kernels.load() is None or not torch.backends.mkldnn.is_available():
        raise SystemExit("needs pdserve's C kernels (a C compiler) and torch with oneDNN")
    results = [measure(int(r), args.repeats) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| rows | pdserve ms/step | pdserve bf16 ms/step | oneDNN ms/step | MKL ms/step | oneDNN / pdserve | "
          "fp32 / bf16 panels |\n|---|---|---|---|---|---|---|")
    for r in results:
        t = r["step_ms"]
        print(f"| {r['rows']} | {t['pdserve']:.2f} | {t['pdserve bf16']:.2f} | {t['onednn']:.2f} | {t['mkl']:.2f} | "
              f"{t['onednn'] / t['pdserve']:.2f}x | {t['pdserve'] / t['pdserve bf16']:.2f}x |")
    print(json.dumps({"bench": "cpu_linear", "results": results}))


if __name__ == "__main__":
    main()
