"""Causal prefill attention on the CPU: pdserve's kernel against the torch path it replaces
(`paged_attention.paged_prefill_attention`, torch's flash attention), call by call in one run,
and the whole prefill of one prompt through the engine with each.

    python benchmarks/prefill_attention.py [--lengths 256,1280,2048] [--threads 1,2]

The serving model's attention shape (8 query heads, 4 KV heads, head dim 64, 16-token blocks) and
its bf16 KV cache. Each length is a whole prompt in one chunk (no cached prefix), and a 256-token
chunk at the end of it (a cached prefix before the chunk). Per call: median ms over `--repeats`
alternating calls, and GFLOP/s counting only the causal products (4 x head_dim multiply-adds per
query head and key it sees, so masked keys a path computes anyway count for nothing). Then the
prefill of one `--prompt`-token prompt by the `serve-llama-40m` engine on one thread, with the
kernel and with the torch path alternating (median of `--repeats`). Prints markdown tables and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from machine import machine_line  # this folder's scripts run with it on sys.path
from pdserve.engine import attention as attention_module
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.kernels import paged_attention as torch_path

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def causal_flops(context_len: int, q_len: int) -> float:
    first = context_len - q_len
    keys_seen = q_len * first + q_len * (q_len + 1) / 2
    return 4 * HEAD_DIM * HEADS * keys_seen


def one_call_each(context_len: int, q_len: int, threads: int, repeats: int) -> dict:
    blocks = -(-context_len // BLOCK)
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    table = torch.randperm(blocks)
    k_new, v_new = (c.index_select(0, table).view(-1, KV_HEADS, HEAD_DIM)[context_len - q_len:context_len].float()
                    for c in (k_cache, v_cache))
    q = torch.randn(q_len, HEADS + 2 * KV_HEADS, HEAD_DIM)[:, :HEADS]
    scale = HEAD_DIM ** -0.5
    calls = {"kernel": lambda: cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, context_len, scale),
             "torch": lambda: torch_path.paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, table,
                                                                 context_len, scale)}
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name, call in calls.items():
        call()  # warm: scratch memory, the library
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    flops = causal_flops(context_len, q_len)
    row = {}
    for name, ts in times.items():
        ms = statistics.median(ts) * 1000
        row[name] = {"ms": ms, "gflops": flops / ms / 1e6}
    row["speedup"] = row["torch"]["ms"] / row["kernel"]["ms"]
    return row


def engine_prefill(prompt_len: int, repeats: int) -> dict:
    """One prompt's prefill (and its first token) on one thread, kernel and torch path alternating."""
    from pdserve.engine.checkpoint import default_model
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(default_model("serve-llama-40m"), num_threads=1, weight_dtype="bfloat16", kv_cache_dtype="bfloat16",
              enable_prefix_caching=False)
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    kernel = cpu_kernels.paged_prefill_attention

    def torch_instead(q, k_cache, v_cache, block_table, context_len, scale, out):
        # The chunk's K/V as the cache holds them: what the torch path is given as k_new, v_new.
        q_len = q.shape[0]
        rows = [c.index_select(0, block_table).flatten(0, 1)[context_len - q_len:context_len].float()
                for c in (k_cache, v_cache)]
        out[:] = torch_path.paged_prefill_attention(q, *rows, k_cache, v_cache, block_table, context_len, scale)

    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for i in range(repeats + 1):
        for name, fn in (("kernel", kernel), ("torch", torch_instead)):
            attention_module.cpu_kernels.paged_prefill_attention = fn
            ids = [rng.randrange(vocab) for _ in range(prompt_len)]
            start = time.perf_counter()
            llm.generate([ids], params)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    attention_module.cpu_kernels.paged_prefill_attention = kernel
    out = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
    return {"prompt_tokens": prompt_len, "kernel_ms": out["kernel"], "torch_ms": out["torch"],
            "kernel_tokens_per_s": prompt_len / out["kernel"] * 1000,
            "torch_tokens_per_s": prompt_len / out["torch"] * 1000, "speedup": out["torch"] / out["kernel"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,1280,2048", help="prompt lengths (context of each chunk)")
    ap.add_argument("--threads", default="1,2", help="torch/kernel threads, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=1280, help="the engine prefill's prompt length (0: skip it)")
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("pdserve's CPU kernels did not build here (see the log): nothing to compare")
    report = {"machine": machine_line(), "calls": [], "engine": None}
    for threads in [int(t) for t in args.threads.split(",")]:
        for length in [int(x) for x in args.lengths.split(",")]:
            for q_len in sorted({length, min(256, length)}, reverse=True):
                row = one_call_each(length, q_len, threads, args.repeats)
                report["calls"].append({"threads": threads, "context": length, "chunk": q_len, **row})
    print(f"machine: {report['machine']}\n")
    print("| threads | context | chunk | torch ms | kernel ms | torch GFLOP/s | kernel GFLOP/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["calls"]:
        print(f"| {r['threads']} | {r['context']} | {r['chunk']} | {r['torch']['ms']:.2f} | {r['kernel']['ms']:.2f} "
              f"| {r['torch']['gflops']:.1f} | {r['kernel']['gflops']:.1f} | {r['speedup']:.2f}x |")
    if args.prompt:
        torch.set_num_threads(1)
        e = report["engine"] = engine_prefill(args.prompt, args.repeats)
        print(f"\nengine prefill of {e['prompt_tokens']} tokens, one thread: torch path {e['torch_ms']:.0f} ms "
              f"({e['torch_tokens_per_s']:.0f} tok/s), kernel {e['kernel_ms']:.0f} ms "
              f"({e['kernel_tokens_per_s']:.0f} tok/s): {e['speedup']:.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
