"""Paged decode attention on one CPU thread, read cold: this tree's kernel against the kernel of an
earlier revision, each on a KV cache in 4 KiB pages (`torch.zeros`, as the engine's `KVCache`)
and in 2 MiB pages (`madvise`), and on a bf16 cache in 4 KiB pages (`kv_cache_dtype: bfloat16`,
for the kernels that read one), interleaved call by call in one run.

    python benchmarks/cpu_attention.py [--against HEAD] [--contexts 200,1500,3000] [--batches 1,4]

The serving model's attention shape (8 query heads, 4 KV heads, head dim 64, 16-token blocks,
fp32): 1 KiB of K and 1 KiB of V per token and layer (half that in bf16). K and V are 256 MiB each, every call gets
fresh random block tables and a 256 MiB write in between flushes the last-level cache, so the
blocks come from memory as in a serving decode step (whose weights alone exceed the cache).
The limit beside them: the same number of bytes read by `torch.sum` over one contiguous run.
Prints a markdown table (median ms per call, and the KV bytes read over that time) and one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from machine import machine_line  # this folder's scripts run with it on sys.path
from pdserve.engine.kernels import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
BLOCKS = 16384  # 256 MiB each for K and V


def on_huge_pages(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor from a 2 MiB boundary of its own mapping, asked for 2 MiB pages."""
    nbytes = torch.Size(shape).numel() * 4
    memory = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # the storage keeps `memory` alive
    start = -raw.data_ptr() % (2 << 20)
    return raw[start:start + nbytes].view(torch.float32).view(shape)


def reads_bf16(source: str) -> bool:
    """Whether a revision's attention entry point takes the cache's dtype (`kv_bf16`, 9490f19 on)."""
    return "const void *v_cache, int kv_bf16" in source


def takes_window(source: str) -> bool:
    """Whether a revision's attention entry point takes a sliding window (#44, after 5cb2f9f)."""
    return "int64_t block_size, int64_t window, float scale" in source


def earlier_kernel(rev: str, out_dir: Path) -> tuple[ctypes.CDLL, bool, bool]:
    """The kernel library built from `rev`'s sources (`cpu_kernels.c`, or since the split by kernel
    `cpu_*.c` and `cpu_*.h`), with the flags this tree builds with, and whether its attention entry
    point takes the cache's dtype."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout

    folder = "platform/engine/kernels"
    names = [n for n in git("ls-tree", "--name-only", f"{rev}:{folder}").split()
             if n.startswith("cpu_") and n.endswith((".c", ".h"))]
    for name in names:
        (out_dir / name).write_text(git("show", f"{rev}:{folder}/{name}"))
    lib = out_dir / "cpu_kernels.so"
    compiler = cpu_kernels._compiler()
    if compiler is None:
        raise SystemExit("no C compiler (cc, gcc or clang) found: install gcc to build the kernels")
    sources = [str(out_dir / n) for n in names if n.endswith(".c")]
    subprocess.run([compiler, *cpu_kernels._FLAGS, *sources, "-o", str(lib), "-lm"], check=True)
    source = "".join((out_dir / n).read_text() for n in names)
    dll, bf16, window = ctypes.CDLL(str(lib)), reads_bf16(source), takes_window(source)
    restype, argtypes = cpu_kernels._SIGNATURES["pdserve_paged_decode_attention_f32"]
    argtypes = argtypes if window else argtypes[:15] + argtypes[16:]
    dll.pdserve_paged_decode_attention_f32.restype = restype
    dll.pdserve_paged_decode_attention_f32.argtypes = argtypes if bf16 else argtypes[:5] + argtypes[6:]
    return dll, bf16, window


def attention_call(lib: ctypes.CDLL, lib_reads_bf16: bool, lib_takes_window: bool, k: torch.Tensor,
                   v: torch.Tensor, batch: int, context: int):
    """One call's closure over fresh inputs: q, random block tables, every sequence `context` long."""
    width = -(-context // BLOCK)
    tables = torch.randperm(BLOCKS)[:batch * width].view(batch, width).contiguous()
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty_like(q)

    dtype_arg = (k.dtype == torch.bfloat16,) if lib_reads_bf16 else ()
    window_arg = (0,) if lib_takes_window else ()  # no window: the whole context

    def call():
        lib.pdserve_paged_decode_attention_f32(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), *dtype_arg, tables.data_ptr(),
            width, lens.data_ptr(), out.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, *window_arg,
            HEAD_DIM ** -0.5, 1)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="the git revision whose kernel is the baseline (default HEAD)")
    ap.add_argument("--contexts", default="200,1500,3000", help="tokens per sequence, comma-separated")
    ap.add_argument("--batches", default="1,4", help="sequences per call, comma-separated")
    ap.add_argument("--repeats", type=int, default=25, help="calls per variant and case (median reported)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    small = (2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"4k": torch.zeros(small).normal_(), "2m": on_huge_pages(small).normal_(),
              "4k bf16": torch.zeros(small, dtype=torch.bfloat16).normal_()}
    flush = torch.zeros(64 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": (cpu_kernels.load(), True, True), args.against: earlier_kernel(args.against, Path(tmp))}
        variants = [(name, pages) for name in libs for pages in caches if libs[name][1] or "bf16" not in pages]
        rows = []
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4  # fp32; bf16 reads half
                line = caches["4k"].view(-1)[:kv_bytes // 4]
                times = {key: [] for key in [*variants, "sum"]}
                for _ in range(args.repeats):
                    for key in times:
                        if key == "sum":
                            call = lambda: line.sum()  # noqa: E731
                        else:
                            cache = caches[key[1]]
                            call = attention_call(*libs[key[0]], cache[0], cache[1], batch, context)
                        flush.add_(1.0)
                        t = time.perf_counter()
                        call()
                        times[key].append(time.perf_counter() - t)
                medians = {key: statistics.median(ts) for key, ts in times.items()}
                rows.append({"context": context, "batch": batch, "kv_bytes": kv_bytes,
                             "ms": {("sum" if key == "sum" else f"{key[0]}, {key[1]} pages"): m * 1e3
                                    for key, m in medians.items()}})

    names = list(rows[0]["ms"])
    print(f"command: python benchmarks/cpu_attention.py --against {args.against} --contexts {args.contexts} "
          f"--batches {args.batches} --repeats {args.repeats}")
    print(f"machine: {machine_line()}, torch {torch.__version__}, one thread\n")
    print("| context | batch | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        cells = [f"{r['ms'][n]:.3f} ms ({r['kv_bytes'] / (2 if 'bf16' in n else 1) / r['ms'][n] / 1e6:.1f} GB/s)"
                 for n in names]
        print(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " |")
    print()
    print(json.dumps({"bench": "cpu_attention", "against": args.against, "results": rows}))


if __name__ == "__main__":
    main()
