"""One draw of Serving part 2's `slo` setup on the real app and in simulation, request by request:
where the simulation's TTFT departs from the real one, by kind of prompt (#46's calibration).

    python benchmarks/simulator_per_request.py --workload mix --rate 2
    python benchmarks/simulator_per_request.py --workload "shared prefixes" --rate 2 --each

The real run is simulator_vs_real.py's (the same app, draw, warm-up and arrivals, 150 requests by
default, about 3 minutes); the simulation is its `--this-machine` one, in this process. Prints
each kind's TTFT percentiles, real against simulated (short and long prompts, and prompts whose
prefix the decode replica held cached), and with `--each` one line a request.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from serving import MIX_SLO, PRESET, _free_port, _start_ray, part2_requests
from simulator_vs_real import simulate_args

KINDS = {"mix": "long-prompt-mix", "shared prefixes": "shared-prefix"}  # simulator_vs_real's names -> part 2's
PERCENTILES = (25, 50, 75, 90)


def real_run(kind: str, rate: float, num_requests: int, seed: int) -> list[tuple[float, int, float]]:
    """(send time from the first, prompt tokens, TTFT s) of each request, in the order sent."""
    import ray
    from ray import serve

    from pdserve.app import build
    from pdserve.bench.runner import RunSettings, run_benchmark, run_on_client_loop, run_requests
    from pdserve.bench.workloads import PromptBuilder, random_workload
    from pdserve.config import ServeConfig
    from pdserve.engine.checkpoint import default_model

    model = str(default_model(PRESET))
    builder = PromptBuilder(model)
    requests = part2_requests(builder, num_requests, seed, KINDS[kind])
    warmup = random_workload(builder, 1, "128", "32", seed=1000)[0]  # serving.py's
    one_core = {"ray_actor_options": {"num_cpus": 1}, "engine": {"num_threads": 1}}
    config = ServeConfig(name="disagg", model=model, prefill=one_core, decode=one_core,
                         engine={"num_threads": 2, "max_num_seqs": 64, "split_prompts_to_fill_steps": False},
                         slo={"ttft_ms": MIX_SLO["ttft"], "itl_ms": MIX_SLO["tpot"]}, transfer={"host": "127.0.0.1"})
    _start_ray(model, "haproxy")
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config), name=config.name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        run_benchmark([warmup], RunSettings(base_url=url, concurrency=1), builder, progress=False)
        settings = RunSettings(base_url=url, concurrency=None, rate=rate, slo=MIX_SLO, seed=0)
        records, _, _ = run_on_client_loop(run_requests(requests, settings, builder, progress=False))
    finally:
        serve.shutdown()
        ray.shutdown()
    records.sort(key=lambda r: r.send_s)
    return [(r.send_s - records[0].send_s, r.prompt_tokens, r.ttft_s) for r in records]


def simulated_run(kind: str, rate: float, num_requests: int, seed: int) -> list[tuple[float, int, int, float]]:
    """(arrival from the first, prompt tokens, tokens the decode replica held cached, TTFT s) of each
    request of the same draw, in arrival order."""
    from pdserve.cli import build_parser
    from pdserve.simulate import cli
    from pdserve.simulate.sim import Simulation

    class Recording(Simulation):
        def first_token(self, req, now):
            firsts[req.id] = (req.arrival, req.prompt, req.prompt - req.uncached, now - req.arrival)
            super().first_token(req, now)

    args = build_parser().parse_args(simulate_args(kind, rate, seed, num_requests, this_machine=True))
    config, requests, _ = cli.build(args)
    firsts: dict[int, tuple] = {}
    Recording(config).run(requests, None, [args.warmup])  # (the warm-up's id is the first request's: overwritten)
    rows = [firsts[i] for i in sorted(firsts)]
    return [(arrival - rows[0][0], *rest) for arrival, *rest in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(KINDS), default="mix")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--each", action="store_true", help="also print every request")
    args = ap.parse_args()
    real = real_run(args.workload, args.rate, args.requests, args.seed)
    sim = simulated_run(args.workload, args.rate, args.requests, args.seed)
    if len(real) != len(sim) or any(r[1] != s[1] for r, s in zip(real, sim)):
        sys.exit("the real and the simulated draws differ: not the same requests")
    kinds: dict[str, list] = {}
    for r, s in zip(real, sim):
        kind = "cached prefix" if s[2] else ("long" if r[1] > 512 else "short")
        kinds.setdefault(kind, []).append((r[2] * 1000, s[3] * 1000))
    print(f"{args.workload}, {args.rate:g} req/s, seed {args.seed}: TTFT ms, real / simulated")
    print("| prompts | count | " + " | ".join(f"p{p}" for p in PERCENTILES) + " |")
    print("|---|---|" + "---|" * len(PERCENTILES))
    for kind, pairs in sorted(kinds.items()):
        cells = [f"{np.percentile([p[0] for p in pairs], q):,.1f} / {np.percentile([p[1] for p in pairs], q):,.1f}"
                 for q in PERCENTILES]
        print(f"| {kind} | {len(pairs)} | " + " | ".join(cells) + " |")
    print(f"all: p50 {statistics.median(r[2] for r in real) * 1000:,.1f} / "
          f"{statistics.median(s[3] for s in sim) * 1000:,.1f}")
    if args.each:
        for i, (r, s) in enumerate(zip(real, sim)):
            print(f"{i:4d} at {r[0]:7.2f} s  prompt {r[1]:5d}  cached {s[2]:5d}  real {r[2] * 1000:8.1f}  "
                  f"sim {s[3] * 1000:8.1f}")


if __name__ == "__main__":
    main()
