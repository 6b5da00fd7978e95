"""Placement with and without its tail margins, in simulation, as a fixed fleet nears its capacity.

    python benchmarks/placement_margin.py                       # 8B on H100, 2 prefill + 3 decode
    python benchmarks/placement_margin.py --rates 60,90 --seeds 1

Each decode replica's placement adds to its TTFT predictions the SLO's percentile of its recent
prediction errors (`pdserve.decode.placement`); the baseline places on the mean predictions
alone (margins held at 0 in this process). Both run the same requests (`pdserve bench`'s
long-prompt mix: 20% of prompts 4-8k tokens) on the same fleet at each rate and seed, in turn.
Prints SLO attainment, p99 TTFT and goodput for each, a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from machine import machine_line  # this folder's scripts run with it on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--accelerator", default="H100")
    ap.add_argument("--prefill-replicas", type=int, default=2)
    ap.add_argument("--decode-replicas", type=int, default=3)
    ap.add_argument("--rates", default="60,75,90,100", help="requests/s, comma-separated")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--duration", type=float, default=300.0, help="simulated seconds of Poisson arrivals")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    args = ap.parse_args()

    import pdserve.decode.placement as placement
    from pdserve.autoscale.joint import Slo
    from pdserve.simulate.hardware import accelerator
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import PoolSpec, SimConfig, Simulation
    from pdserve.simulate.workload import WorkloadSpec, bench_requests

    started = time.perf_counter()
    acc = accelerator(args.accelerator)
    spec = WorkloadSpec("long-prompt-mix", input_len="256:1024", output_len="64:256", long_len="4096:8192",
                        long_fraction=0.2)
    config = SimConfig(model=load_model(args.model, 2, 2), decode=PoolSpec(acc, args.decode_replicas),
                       prefill=PoolSpec(acc, args.prefill_replicas),
                       slo=Slo(args.ttft_ms / 1000, args.itl_ms / 1000, 99.0), max_num_seqs=256)
    min_samples = placement.MIN_ERROR_SAMPLES
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            row = {"rate": rate, "seed": seed}
            for name, samples in (("mean", 10**12), ("margin", min_samples)):
                placement.MIN_ERROR_SAMPLES = samples  # 10**12: no path ever has enough errors for a margin
                r = Simulation(config).run(bench_requests(spec, seed, rate=rate, duration_s=args.duration))
                row[name] = {"slo_attainment": r["slo_attainment"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                             "itl_p99_ms": r["itl_ms"]["p99"], "goodput_rps": r["goodput_rps"],
                             "local": sum(n for k, n in r["placements"].items() if k.startswith("local"))}
            rows.append(row)
            m, b = row["margin"], row["mean"]
            print(f"{rate:g} req/s seed {seed}: attainment {b['slo_attainment']:.3f} -> {m['slo_attainment']:.3f}, "
                  f"goodput {b['goodput_rps']:.2f} -> {m['goodput_rps']:.2f}", flush=True)
    placement.MIN_ERROR_SAMPLES = min_samples
    print(f"\n{machine_line()}\n{args.model} on {args.accelerator}, {args.prefill_replicas} prefill + "
          f"{args.decode_replicas} decode; SLO TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms at p99; "
          f"{args.duration:g} s of arrivals a run\n")
    print("| rate req/s | seed | attainment (mean / margin) | p99 TTFT ms | p99 ITL ms | goodput req/s | "
          "prompts prefilled locally |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        b, m = row["mean"], row["margin"]
        print(f"| {row['rate']:g} | {row['seed']} | {b['slo_attainment']:.3f} / {m['slo_attainment']:.3f} | "
              f"{b['ttft_p99_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {b['itl_p99_ms']:.1f} / {m['itl_p99_ms']:.1f} | "
              f"{b['goodput_rps']:.2f} / {m['goodput_rps']:.2f} | {b['local']} / {m['local']} |")
    print(json.dumps({"bench": "placement_margin", "machine": machine_line(), "args": vars(args), "rows": rows,
                      "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
