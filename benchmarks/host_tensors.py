"""The ints a decode step or a KV pull turns into a tensor, by `torch.tensor` (what the runner and
the block copies called before) and through numpy (`engine/host_tensors.long_tensor`), side by
side in one run, at the sizes they have. Host time on the CPU: on a GPU the host-to-device copy
follows either way.

    python benchmarks/host_tensors.py [--repeats 2000]

Sizes: a step's integers (token ids, positions, slots, lengths and its decode block tables of 16
tokens a block) at batch 1 / 64 / 256 with contexts of 1k / 1k / 4k tokens, and the block ids of a
128 MiB pull of the 8B shape (256 blocks each side, as one list).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

from machine import machine_line  # this folder's scripts run with it on sys.path

from pdserve.engine.host_tensors import long_tensor

SIZES = {"batch-1 step, 1k context": 5 * 1 + 64, "batch-64 step, 1k context": 5 * 64 + 64 * 64,
         "batch-256 step, 4k context": 5 * 256 + 256 * 256, "a 128 MiB pull's block ids": 512}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    print(machine_line())
    print("| ints | torch.tensor (us) | long_tensor (us) | ratio |\n|---|---|---|---|")
    for name, n in SIZES.items():
        values = list(range(n))
        number = max(3, args.repeats * 64 // n)
        ways = {"torch.tensor": lambda: torch.tensor(values, dtype=torch.long),
                "long_tensor": lambda: long_tensor(values, "cpu")}
        # Alternated, five rounds, the median: the machine's noise falls on both alike.
        times = {k: [] for k in ways}
        for _ in range(5):
            for k, fn in ways.items():
                times[k].append(timeit.timeit(fn, number=number) / number * 1e6)
        a, b = (statistics.median(times[k]) for k in ways)
        print(f"| {name} ({n:,}) | {a:,.1f} | {b:,.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
