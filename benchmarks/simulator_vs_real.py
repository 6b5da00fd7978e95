"""The simulator against the real app (#46's calibration clause): Serving part 2's `slo` runs
replayed in simulation, draw by draw, and the four latency figures side by side.

    python benchmarks/serving.py --part 2 --mix-setups slo --rates 2,3 --seeds 1 --requests 150 > mix.txt
    python benchmarks/serving.py --part 2 --mix-setups slo --rates 2,3 --seeds 1 --requests 150 \\
        --mix-workload shared-prefix > shared.txt
    python benchmarks/simulator_vs_real.py mix.txt shared.txt

Each real draw (`RATE req/s, mix seed S` or `..., shared prefixes seed S`) is simulated with the
same requests and arrival times (`pdserve simulate`, bench's generators and seeds, the tokenizer
the real prompts were built with) after the same warm-up request, on the cpu profile alone
(`sim`: each replica its own core, no request path) and on this machine (`--this-machine`:
cpu_host.json's shared cores and path). Prints a markdown table: each figure simulated / real and
the difference.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

from serving import MIX_SETUPS, MIX_SLO, PRESET  # this folder's scripts run with it on sys.path

WORKLOADS = {
    "mix": ["--workload", "long-prompt-mix", "--input-len", "64:128", "--long-len", "1024:1536", "--output-len", "48",
            "--long-fraction", "0.2", "--long-output-len", "16"],
    "shared prefixes": ["--workload", "shared-prefix", "--num-tenants", "8", "--system-prompt-len", "1000",
                        "--question-len", "32:96", "--output-len", "48"],
}
WARMUP = "128:32"  # serving.py's `warmup`: each app serves one request alone before its draw
FIGURES = (("p50 TTFT", "ttft_ms", "p50", "median_ttft_ms"), ("p99 TTFT", "ttft_ms", "p99", "p99_ttft_ms"),
           ("p50 ITL", "itl_ms", "p50", "median_itl_ms"), ("p99 ITL", "itl_ms", "p99", "p99_itl_ms"))


def simulate_args(kind: str, rate: float, seed: int, num_requests: int, this_machine: bool) -> list[str]:
    """`pdserve simulate`'s arguments for a real draw (its requests, arrivals, warm-up and app)."""
    from pdserve.engine.checkpoint import default_model

    return ["simulate", "--accelerator", "cpu", *WORKLOADS[kind], "--num-requests", str(num_requests),
            "--rate", str(rate), "--seed", str(seed), "--arrival-seed", "0", "--tokenizer", str(default_model(PRESET)),
            "--ttft-ms", str(MIX_SLO["ttft"]), "--itl-ms", str(MIX_SLO["tpot"]), "--max-num-seqs", "64",
            "--no-split-prompts-to-fill-steps", "--warmup", WARMUP, *(["--this-machine"] if this_machine else [])]


def simulate(kind: str, rate: float, seed: int, num_requests: int, this_machine: bool) -> dict:
    cmd = ["pdserve", *simulate_args(kind, rate, seed, num_requests, this_machine), "--json", "--no-progress"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", nargs="+", help="benchmarks/serving.py part 2 outputs (their last JSON line is read)")
    ap.add_argument("--within", type=float, default=0.25, help="the clause's bound (default %(default)s)")
    args = ap.parse_args()
    rows, hits = [], {"sim": 0, "this machine": 0}
    for path in args.outputs:
        report = json.loads([line for line in open(path) if line.startswith("{")][-1])
        for draw, by_setup in report["interference"].items():
            rate, kind, seed = re.fullmatch(r"([\d.]+) req/s, (.+) seed (\d+)", draw).groups()
            real = by_setup[MIX_SETUPS["slo"]]
            sims = {name: simulate(kind, float(rate), int(seed), real["num_requests"], flag)
                    for name, flag in (("sim", False), ("this machine", True))}
            cells = []
            for _, key, p, real_key in FIGURES:
                parts = []
                for name, sim in sims.items():
                    diff = sim[key][p] / real[real_key] - 1
                    hits[name] += abs(diff) <= args.within
                    parts.append(f"{sim[key][p]:,.1f} ({diff:+.0%})")
                cells.append(f"{' / '.join(parts)} / {real[real_key]:,.1f}")
            rows.append(f"| {kind}, {rate} req/s | " + " | ".join(cells) + " |")
    print("| workload, rate | " + " | ".join(f"{name} ms (sim / this machine / real)" for name, *_ in FIGURES) + " |")
    print("|---|" + "---|" * len(FIGURES))
    print("\n".join(rows))
    total = len(rows) * len(FIGURES)
    print(f"\nwithin {args.within:.0%}: sim {hits['sim']} of {total}, this machine {hits['this machine']} of {total}")


if __name__ == "__main__":
    sys.exit(main())
