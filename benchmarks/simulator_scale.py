"""How fast `pdserve simulate` runs at scale: wall time against simulated time, per event and per request.

    python benchmarks/simulator_scale.py                       # 1,000 replicas, 10,000 req/s, 600 simulated s
    python benchmarks/simulator_scale.py --duration 60         # the same fleet and rate for a tenth of the time
    python benchmarks/simulator_scale.py --replicas 100 --rate 1000 --duration 30   # a smoke check

The deployment: `--model` (default llama-3.1-8b, bf16) on `--accelerator` (default H100) replicas,
`--prefill-share` of them prefill (default 0.3), the rest decode; `pdserve bench`'s random workload
(`--input-len 256:2048`, `--output-len 64:512` by default) as a Poisson stream at `--rate`; SLO
TTFT 1 s, ITL 50 ms at p99. One process, one thread: the simulation is single-threaded. Prints
the machine line, the load average before and after, wall and CPU seconds (on a shared machine
the process's CPU time is what it would take alone), a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from machine import machine_line  # this folder's scripts run with it on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--prefill-share", type=float, default=0.3)
    ap.add_argument("--rate", type=float, default=10_000.0, help="requests/s")
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--accelerator", default="H100")
    ap.add_argument("--input-len", default="256:2048")
    ap.add_argument("--output-len", default="64:512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args()

    from tqdm import tqdm

    from pdserve.autoscale.joint import Slo
    from pdserve.simulate.hardware import accelerator
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import PoolSpec, SimConfig, Simulation
    from pdserve.simulate.workload import WorkloadSpec, bench_requests

    num_prefill = round(args.replicas * args.prefill_share)
    acc = accelerator(args.accelerator)
    model = load_model(args.model, 2, 2)
    config = SimConfig(model=model, decode=PoolSpec(acc, args.replicas - num_prefill),
                       prefill=PoolSpec(acc, num_prefill),
                       slo=Slo(1.0, 0.05, 99.0), max_num_seqs=256, seed=args.seed)
    load_before = os.getloadavg()
    sim = Simulation(config)
    requests = bench_requests(WorkloadSpec("random", args.input_len, args.output_len), args.seed, rate=args.rate,
                              duration_s=args.duration)
    bar = tqdm(total=args.duration, unit="sim s", desc="simulating", disable=not args.progress, file=sys.stderr)
    started, cpu_started = time.perf_counter(), time.process_time()
    result = sim.run(requests, lambda t: bar.update(round(t, 1) - bar.n))
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    bar.close()
    load_after = os.getloadavg()
    max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {"bench": "simulator_scale", "machine": machine_line(), "load_average_before": load_before,
              "load_average_after": load_after,
              "replicas": {"prefill": num_prefill, "decode": args.replicas - num_prefill},
              "model": args.model, "accelerator": args.accelerator, "rate": args.rate, "duration_s": args.duration,
              "workload": {"input_len": args.input_len, "output_len": args.output_len},
              "wall_s": wall_s, "cpu_s": cpu_s, "simulated_s": result["simulated_s"],
              "num_requests": result["num_requests"],
              "num_events": result["num_events"], "real_time_ratio": result["simulated_s"] / wall_s,
              "real_time_ratio_cpu": result["simulated_s"] / cpu_s,
              "us_per_event": wall_s / result["num_events"] * 1e6,
              "us_per_request": wall_s / result["num_requests"] * 1e6, "max_rss_mib": max_rss_mib,
              "ttft_ms": result["ttft_ms"], "itl_ms": result["itl_ms"], "slo_attainment": result["slo_attainment"],
              "placements": result["placements"]}
    print(f"\n{report['machine']}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print("| replicas (prefill + decode) | rate req/s | simulated s | requests | events | wall s | CPU s | "
          "simulated / wall | simulated / CPU | us per event (wall) | max RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {num_prefill} + {args.replicas - num_prefill} | {args.rate:g} | {result['simulated_s']:.1f} | "
          f"{result['num_requests']} | {result['num_events']} | {wall_s:.1f} | {cpu_s:.1f} | "
          f"{report['real_time_ratio']:.3f} | {report['real_time_ratio_cpu']:.3f} | {report['us_per_event']:.2f} | "
          f"{max_rss_mib:.0f} |")
    print(f"\nTTFT p50/p99 {result['ttft_ms']['p50']:.1f}/{result['ttft_ms']['p99']:.1f} ms, ITL p50/p99 "
          f"{result['itl_ms']['p50']:.2f}/{result['itl_ms']['p99']:.2f} ms, "
          f"SLO attainment {result['slo_attainment']:.4f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
