"""One engine's decode step on one thread, as a one-core decode replica runs it, by batch size and
context length, for each weight and KV-cache dtype: fp32 throughout, weight-only bf16
(`weight_dtype: bfloat16`), and bf16 weights with a bf16 KV cache. All engines live in this
process and take turns, setting by setting within each round, so they see the same machine.

    python benchmarks/decode_step.py [--batches 1,3,5,7] [--contexts 128,1500] [--rounds 3] [--settings fp32]

`--settings fp32` runs on a tree from before `weight_dtype` too (put that tree's package first on
PYTHONPATH), to compare revisions in alternating runs.

Model: the `serve-llama-40m` preset the serving benchmarks stream (hidden 512, 8 layers, vocab
1,024; ~98 MB of fp32 weights). A step's time is the median of `--steps` steps of pure decode
(every sequence past its prompt), the median over rounds. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from machine import machine_line, warn_if_pinned  # this folder's scripts run with it on sys.path

PRESET = "serve-llama-40m"
SETTINGS = {"fp32": {}, "bf16 weights": {"weight_dtype": "bfloat16"},
            "bf16 weights + KV": {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}}


def step_ms(llm, batch: int, context: int, steps: int) -> float:
    """Median ms of a decode step of `batch` sequences whose prompts are `context` tokens long."""
    from pdserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    vocab = llm.tokenizer.vocab_size
    for i in range(batch):  # distinct prompts: no blocks shared between the sequences
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", [5 + (7 * i + t) % (vocab - 5) for t in range(context)],
                           params)
    while any(s.num_output_tokens < 2 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills, and the first decode step
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,3,5,7", help="sequences per step, comma-separated")
    ap.add_argument("--contexts", default="128,1500", help="prompt tokens per sequence, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per measurement")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="which settings, comma-separated")
    args = ap.parse_args()
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}
    warn_if_pinned()
    from pdserve.engine.checkpoint import default_model
    from pdserve.engine.llm import LLM

    model = str(default_model(PRESET))
    llms = {name: LLM(model, num_threads=1, max_num_seqs=64, kv_cache_memory_bytes=512 * 2**20, **options)
            for name, options in settings.items()}
    cases = [(b, c) for c in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))]
    times: dict[str, dict[str, list[float]]] = {name: {f"{b}x{c}": [] for b, c in cases} for name in settings}
    for _ in range(args.rounds):
        for b, c in cases:
            for name, llm in llms.items():
                times[name][f"{b}x{c}"].append(step_ms(llm, b, c, args.steps))
    medians = {name: {case: statistics.median(ts) for case, ts in by_case.items()} for name, by_case in times.items()}
    both = {"fp32", "bf16 weights"} <= set(settings)
    print(f"\n{machine_line()}; model {PRESET}, one thread\n")
    print("| sequences x context | " + " | ".join(f"{n} ms" for n in settings)
          + (" | fp32 / bf16 weights |" if both else " |"))
    print("|---|" + "---|" * (len(settings) + both))
    for b, c in cases:
        row = {n: medians[n][f"{b}x{c}"] for n in settings}
        ratio = f" {row['fp32'] / row['bf16 weights']:.2f}x |" if both else ""
        print(f"| {b} x {c} | " + " | ".join(f"{t:.2f}" for t in row.values()) + " |" + ratio)
    print(json.dumps({"bench": "decode_step", "machine": machine_line(), "model": PRESET, "ms": times}))


if __name__ == "__main__":
    main()
