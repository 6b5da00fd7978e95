"""Joint P:D autoscaling against the best fixed split, in simulation, under a bursty load.

    python benchmarks/simulator_bursty.py                       # 8B on H100, 50 <-> 200 req/s, 600 s
    python benchmarks/simulator_bursty.py --low 500 --high 2000 --max-total-replicas 400
    python benchmarks/simulator_bursty.py --low 2000 --high 8000 --max-total-replicas 1000 --splits 80+120,120+200

1. `pdserve plan`'s search (pdserve.simulate.plan) at the trace's average rate, and at its peak
   rate, finds the fixed disaggregated split with the fewest GPUs that meets the SLO there (up to
   --max-total-replicas). With --splits the two splits are given instead (at hundreds of replicas
   the search, every split up to the answer's size, is out of reach).
2. The bursty trace: the rate steps between --low and --high (4x by default) every --period
   seconds, Poisson within each step; `pdserve bench`'s random workload.
3. The same trace runs on both fixed splits, and on the joint policy (`pdserve.autoscale.joint`,
   ticking every 5 s, replicas taking --replica-start-s to start) starting from the average's
   split within --max-total-replicas. Each reports SLO attainment and replica-seconds. --setups
   runs some of the three only (at 1,000 replicas, each one is half an hour here).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from machine import machine_line  # this folder's scripts run with it on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--accelerator", default="H100")
    ap.add_argument("--low", type=float, default=50.0, help="requests/s between bursts")
    ap.add_argument("--high", type=float, default=200.0, help="requests/s in a burst")
    ap.add_argument("--period", type=float, default=120.0, help="seconds of each step")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--max-total-replicas", type=int, default=40)
    ap.add_argument("--replica-start-s", type=float, default=30.0)
    ap.add_argument("--plan-duration", type=float, default=120.0,
                    help="simulated seconds of Poisson arrivals each split of the plan search runs")
    ap.add_argument("--input-len", default="256:2048")
    ap.add_argument("--output-len", default="64:512")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--splits", help="the average's and the peak's fixed splits, prefill+decode each "
                                     "(e.g. 80+120,120+200), instead of pdserve plan's search")
    ap.add_argument("--setups", default="average,peak,joint",
                    help="which setups to run, of average (the average's fixed split), peak, joint: at 1,000 "
                         "replicas each is ~30 min here")
    args = ap.parse_args()

    from dataclasses import replace

    from pdserve.autoscale.joint import Slo
    from pdserve.simulate import plan
    from pdserve.simulate.hardware import accelerator
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import AutoscaleSpec, PoolSpec, SimConfig, Simulation
    from pdserve.simulate.workload import WorkloadSpec, alternating_steps, bench_requests, mean_rate

    started = time.perf_counter()
    acc = accelerator(args.accelerator)
    spec = WorkloadSpec("random", args.input_len, args.output_len)
    steps = alternating_steps(args.low, args.high, args.period, args.duration)
    average = mean_rate(steps, args.duration)
    base = SimConfig(model=load_model(args.model, 2, 2), decode=PoolSpec(acc, 1), prefill=None,
                     slo=Slo(args.ttft_ms / 1000, args.itl_ms / 1000, 99.0), max_num_seqs=256, seed=args.seed)
    def smallest_split(rate: float) -> tuple[dict, int]:
        """`pdserve plan`'s search at `rate`, disaggregated splits only (the joint policy sizes two
        pools), stopping at the first GPU count with a split that meets the SLO."""
        requests = list(bench_requests(spec, args.seed, rate=rate, duration_s=args.plan_duration))
        best, tried = plan.smallest(base, plan.candidates(base, [acc], [1], args.max_total_replicas, colocated=False),
                                    requests)
        if best is None:
            raise SystemExit(f"no split of up to {args.max_total_replicas} replicas meets the SLO at {rate:g} req/s")
        return best, tried

    def given_split(text: str) -> tuple[dict, int]:
        p, d = (int(n) for n in text.split("+"))
        return {"_candidate": replace(base, prefill=PoolSpec(acc, p), decode=PoolSpec(acc, d)),
                "candidate": f"prefill {p} x {acc.name} TP1, decode {d} x {acc.name} TP1 (given)"}, 0

    if args.splits:
        (at_average, tried_average), (at_peak, tried_peak) = (given_split(t) for t in args.splits.split(","))
    else:
        at_average, tried_average = smallest_split(average)
        at_peak, tried_peak = smallest_split(max(args.low, args.high))
    fixed = at_average["_candidate"]

    def bursty():
        return bench_requests(spec, args.seed + 1, rate_steps=steps, duration_s=args.duration)

    peak = at_peak["_candidate"]
    setups = {"average": ("fixed split (plan at the average rate)", replace(base, decode=fixed.decode,
                                                                           prefill=fixed.prefill)),
              "peak": ("fixed split (plan at the peak rate)", replace(base, decode=peak.decode, prefill=peak.prefill)),
              "joint": ("joint autoscaling", replace(base, decode=fixed.decode, prefill=fixed.prefill,
                                                     autoscale=AutoscaleSpec(args.max_total_replicas, tick_s=5.0,
                                                                             downscale_delay_s=30.0,
                                                                             replica_start_s=args.replica_start_s)))}
    chosen = args.setups.split(",")
    if unknown := set(chosen) - setups.keys():
        ap.error(f"--setups: no setup {', '.join(sorted(unknown))} (average, peak, joint)")
    runs = dict(setups[key] for key in chosen)
    def simulate(name: str, cfg) -> dict:
        with tqdm(total=args.duration, desc=name, unit="sim s", file=sys.stderr) as bar:
            return Simulation(cfg).run(bursty(), lambda t: bar.update(round(min(t, args.duration), 1) - bar.n))

    results = {name: simulate(name, cfg) for name, cfg in runs.items()}
    report = {"bench": "simulator_bursty", "machine": machine_line(), "model": args.model,
              "accelerator": args.accelerator, "rate_steps": steps, "average_rate": average,
              "slo": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "percentile": 99.0},
              "plan": {"at_average": at_average["candidate"], "at_peak": at_peak["candidate"],
                       "splits_tried": tried_average + tried_peak},
              "replica_start_s": args.replica_start_s,
              "runs": {name: {k: r[k] for k in ("num_requests", "slo_attainment", "goodput_rps", "replica_seconds",
                                                  "ttft_ms", "itl_ms", "final_replicas", "placements")}
                       for name, r in results.items()},
              "wall_s": time.perf_counter() - started}
    print(f"\n{report['machine']}\n{args.model} on {args.accelerator}; rate {args.low:g} <-> {args.high:g} req/s every "
          f"{args.period:g} s for {args.duration:g} s (average {average:g}); SLO TTFT {args.ttft_ms:g} ms, ITL "
          f"{args.itl_ms:g} ms at p99; new replicas start in {args.replica_start_s:g} s\nplan at the average rate: "
          f"{at_average['candidate']}; at the peak: {at_peak['candidate']}\n")
    print("| setup | SLO attainment | p99 TTFT ms | p99 ITL ms | replica-seconds (prefill + decode) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        rs = r["replica_seconds"]
        print(f"| {name} | {r['slo_attainment']:.3f} | {r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p99']:.1f} | "
              f"{rs['total']:.0f} ({rs['prefill']:.0f} + {rs['decode']:.0f}) |")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
