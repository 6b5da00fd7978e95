"""Joint P:D autoscaling on the real app under a bursty load, against the fixed splits `pdserve plan`
finds (#46), each beside its simulation.

    python benchmarks/bursty_real.py                     # 0.75 <-> 3 req/s, 60 s steps, 240 s a setup (~16 min)
    python benchmarks/bursty_real.py --low 0.5 --high 2 --period 120 --duration 480 --setups average,joint

1. The plan: `pdserve plan`'s search (pdserve.simulate.plan, disaggregated splits) on the cpu
   profile with this machine's host profile (cpu_host.json: every replica and the request path
   share its cores) finds the split with the fewest replicas that meets the SLO at the trace's
   average rate, and at its peak, up to --max-total-replicas.
2. The trace: the rate steps between --low and --high every --period seconds, Poisson within a
   step (the arrival times the simulator gives --seed); the requests are `pdserve bench`'s random
   workload (--input-len, --output-len: chat-sized prompts, long answers), sent at their times
   by its runner through HAProxy and the gateway to serve-llama-40m (fp32, as the cpu profile
   was calibrated). Each engine runs --max-num-seqs sequences at once: standing for the KV
   memory that bounds a GPU replica's streams, the bound a decode pool is sized by, since on
   this machine's two cores more replicas add no compute. (A decode replica, real or simulated,
   takes up to its pool's max_ongoing_requests, 64, and holds those beyond its slots with their
   KV until a slot frees.)
3. The setups, one after the other on one Ray: the average's fixed split, the peak's (where one
   meets the SLO there) and joint autoscaling as a user writes it (`slo`, both pools autoscaling
   from one replica, `max_total_replicas`: pdserve.autoscale.policies.JointSloPolicy). Each
   reports SLO attainment (first token and mean inter-token gap within the targets, as `pdserve
   bench` counts) over the trace and per step, p99 TTFT and ITL, and replica-seconds: the replicas
   Serve holds in any state (a starting or draining replica holds its device too), read from
   serve.status() each second from the first request sent to the last answered. The same
   requests run through the simulator (the same split, or the joint policy ticking every 5 s) on
   this machine's profile.
Prints a table, each setup's replica timeline, and one JSON line (--out: the same, to a file).

The SLO is serving.py part 2's (4 s to the first token, 150 ms mean between tokens, 99%).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import replace

from machine import machine_line, warn_if_pinned  # this folder's scripts run with it on sys.path
from serving import MIX_SLO, PRESET, _free_port, _start_ray

SETUPS = ("average", "peak", "joint")
SETUP_NAMES = {"average": "fixed split (plan at the average rate)", "peak": "fixed split (plan at the peak rate)",
               "joint": "joint autoscaling"}
# As serving.py part 2's pools: each replica one core, one engine thread.
ENGINE = {"num_threads": 1, "split_prompts_to_fill_steps": False}
POOLS = ("Prefill", "Decode")


class ReplicaClock(threading.Thread):
    """Each pool's replicas (any state) from serve.status(), every `period_s`, with the time read,
    and how many replicas were not running yet (starting)."""

    def __init__(self, app: str, period_s: float = 1.0):
        super().__init__(daemon=True)
        self.app, self.period_s = app, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.starting: list[int] = []  # per sample, replicas of both pools in STARTING
        self._done = threading.Event()

    def run(self) -> None:
        from ray import serve

        from pdserve.telemetry.status import state_name

        while not self._done.is_set():
            t = time.perf_counter()
            app = serve.status().applications.get(self.app)
            if app is not None:
                pools = {name: app.deployments[name].replica_states for name in POOLS if name in app.deployments}
                self.samples.append((t, {name: sum(states.values()) for name, states in pools.items()}))
                self.starting.append(sum(n for states in pools.values() for state, n in states.items()
                                         if state_name(state) == "STARTING"))
            self._done.wait(max(0.0, self.period_s - (time.perf_counter() - t)))

    def mean_start_s(self) -> float | None:
        """How long a replica started during the run took to serve: the seconds replicas spent
        starting over the replicas added (None: none was)."""
        added = sum(max(0, sum(b.values()) - sum(a.values())) for (_, a), (_, b) in zip(self.samples, self.samples[1:]))
        starting_s = sum(n * (b[0] - a[0]) for n, a, b in zip(self.starting, self.samples, self.samples[1:]))
        return starting_s / added if added else None

    def stop(self) -> None:
        self._done.set()
        self.join()

    def replica_seconds(self, start: float, end: float) -> dict[str, float]:
        """Each pool's replicas integrated over [start, end] (each sample holds until the next)."""
        out = dict.fromkeys(POOLS, 0.0)
        for (t, counts), (t_next, _) in zip(self.samples, self.samples[1:] + [(end, {})]):
            span = min(t_next, end) - max(t, start)
            if span > 0:
                for name in POOLS:
                    out[name] += counts.get(name, 0) * span
        return {"prefill": out["Prefill"], "decode": out["Decode"], "total": out["Prefill"] + out["Decode"]}


def app_config(name: str, model: str, args, split: tuple[int, int] | None):
    """A fixed (prefill, decode) split, or joint autoscaling within the budget (split None)."""
    from pdserve.config import ServeConfig

    slo = {"ttft_ms": MIX_SLO["ttft"], "itl_ms": MIX_SLO["tpot"]}
    one_core = {"ray_actor_options": {"num_cpus": 1}}
    if split is None:
        auto = {"min_replicas": 1, "max_replicas": args.max_total_replicas - 1, "upscale_delay_s": 0,
                "downscale_delay_s": args.downscale_delay_s}
        pools = {"prefill": {**one_core, "autoscaling": auto}, "decode": {**one_core, "autoscaling": auto},
                 "max_total_replicas": args.max_total_replicas}
    else:
        pools = {"prefill": {**one_core, "num_replicas": split[0]}, "decode": {**one_core, "num_replicas": split[1]}}
    return ServeConfig(name=name, model=model, engine={**ENGINE, "max_num_seqs": args.max_num_seqs}, slo=slo,
                       transfer={"host": "127.0.0.1"}, **pools)


def real_run(config, requests, builder, warmup, steps, port: int) -> dict:
    """Deploy `config` through Serve's config path, send the trace, tear it down."""
    from ray import serve

    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.runner import RunSettings, run_benchmark, run_on_client_loop, run_requests
    from pdserve.launch import deploy

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(config)
    clock = ReplicaClock(config.name)
    clock.start()  # (its figures are counted from the first request on)
    try:
        settings = RunSettings(base_url=f"http://127.0.0.1:{port}", slo=MIX_SLO, seed=0)
        run_benchmark([warmup], replace(settings, concurrency=1), builder, progress=False)
        start = time.perf_counter()
        records, duration, _ = run_on_client_loop(run_requests(requests, settings, builder, progress=True))
        end = time.perf_counter()
    finally:
        clock.stop()
        serve.shutdown()
    result = {k: v for k, v in compute_metrics(records, duration, MIX_SLO).items()
              if k in ("num_requests", "completed", "errors", "slo_attainment", "p99_ttft_ms", "median_ttft_ms",
                       "p99_itl_ms", "median_itl_ms")}
    bounds = [s[0] for s in steps[1:]] + [float("inf")]
    result["step_attainment"] = [
        compute_metrics(part, 1.0, MIX_SLO)["slo_attainment"]
        for part in ([r for r in records if a <= r.send_s - start < b] for (a, _), b in zip(steps, bounds))]
    result["replica_seconds"] = clock.replica_seconds(start, end)
    result["replica_start_s"] = clock.mean_start_s()
    result["timeline"] = [(round(t - start, 1), counts.get("Prefill", 0), counts.get("Decode", 0))
                          for t, counts in clock.samples if start <= t <= end]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--low", type=float, default=0.75, help="requests/s between bursts")
    ap.add_argument("--high", type=float, default=3.0, help="requests/s in a burst")
    ap.add_argument("--period", type=float, default=60.0, help="seconds of each step")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of the trace")
    ap.add_argument("--input-len", default="64:128", help="prompt tokens (a range draws uniformly)")
    ap.add_argument("--output-len", default="128:384", help="output tokens")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="the engines' max_num_seqs (default %(default)s)")
    ap.add_argument("--max-total-replicas", type=int, default=4)
    ap.add_argument("--downscale-delay-s", type=float, default=20.0,
                    help="joint autoscaling: how long a pool's want stays low before it shrinks")
    ap.add_argument("--plan-duration", type=float, default=120.0,
                    help="simulated seconds of Poisson arrivals each split of the plan search runs")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of " + ",".join(SETUPS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args()
    setups = args.setups.split(",")
    if not set(setups) <= set(SETUPS):
        ap.error(f"--setups: choose from {','.join(SETUPS)}")
    warn_if_pinned()

    import ray

    from pdserve.autoscale.joint import Slo
    from pdserve.bench.workloads import PromptBuilder, random_workload
    from pdserve.engine.checkpoint import default_model
    from pdserve.simulate import plan
    from pdserve.simulate.hardware import accelerator, load_host
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import AutoscaleSpec, PoolSpec, SimConfig, Simulation
    from pdserve.simulate.workload import (SimRequest, WorkloadSpec, alternating_steps, arrival_times,
                                           bench_requests, mean_rate, tokenizer_pool_size)

    model = str(default_model(PRESET))
    steps = alternating_steps(args.low, args.high, args.period, args.duration)
    average, peak = mean_rate(steps, args.duration), max(args.low, args.high)
    cpu = accelerator("cpu")
    base = SimConfig(model=load_model(model), decode=PoolSpec(cpu, 1), prefill=None,
                     slo=Slo(MIX_SLO["ttft"] / 1000, MIX_SLO["tpot"] / 1000, 99.0), max_num_seqs=args.max_num_seqs,
                     split_prompts_to_fill_steps=False, seed=args.seed, host=load_host())
    spec = WorkloadSpec("random", args.input_len, args.output_len)
    pool_size = tokenizer_pool_size(model)
    pool = plan.candidates(base, [cpu], [1], args.max_total_replicas, colocated=False)
    planned = {}
    for name, rate in (("average", average), ("peak", peak)):
        requests = list(bench_requests(spec, args.seed, rate=rate, duration_s=args.plan_duration, pool_size=pool_size))
        best, _ = plan.smallest(base, pool, requests)
        planned[name] = best and (best["_candidate"].prefill.num_replicas, best["_candidate"].decode.num_replicas)
        print(f"plan at the {name} rate ({rate:g} req/s): "
              f"{best['candidate'] if best else f'no split of up to {args.max_total_replicas} meets the SLO'}",
              flush=True)

    builder = PromptBuilder(model)
    times = arrival_times(steps, args.duration, args.seed)
    requests = [replace(r, offset_s=t) for r, t in
                zip(random_workload(builder, len(times), args.input_len, args.output_len, seed=args.seed), times)]
    sim_requests = [SimRequest(r.offset_s, r.prompt_tokens, r.max_tokens) for r in requests]
    warmup = random_workload(builder, 1, "128", "32", seed=1000)[0]

    report = {"bench": "bursty_real", "machine": machine_line(), "model": PRESET, "rate_steps": steps,
              "average_rate": average, "num_requests": len(requests), "slo_ms": MIX_SLO,
              "max_total_replicas": args.max_total_replicas, "downscale_delay_s": args.downscale_delay_s,
              "plan": planned, "runs": {}}
    _start_ray(model, "haproxy")
    try:
        for setup in setups:
            split = planned.get(setup)
            if setup != "joint" and split is None:
                print(f"{SETUP_NAMES[setup]}: none (no split meets the SLO at that rate)", flush=True)
                continue
            cfg = app_config(setup, model, args, split)
            print(f"{SETUP_NAMES[setup]}: {len(requests)} requests over {args.duration:g} s", flush=True)
            real = real_run(cfg, requests, builder, warmup, steps, _free_port())
            sim_cfg = replace(base, decode=PoolSpec(cpu, split[1] if split else 1),
                              prefill=PoolSpec(cpu, split[0] if split else 1),
                              autoscale=None if split else AutoscaleSpec(
                                  args.max_total_replicas, downscale_delay_s=args.downscale_delay_s,
                                  replica_start_s=real["replica_start_s"] or 0.0))
            sim = Simulation(sim_cfg).run(iter(sim_requests))
            report["runs"][setup] = {"split": split, "real": real, "sim": {
                "slo_attainment": sim["slo_attainment"], "p99_ttft_ms": sim["ttft_ms"].get("p99"),
                "p99_itl_ms": sim["itl_ms"].get("p99"), "replica_seconds": sim["replica_seconds"]}}
    finally:
        ray.shutdown()
        _print(report, args)


def _print(report: dict, args) -> None:
    print(f"\n{report['machine']}\n{report['model']}, prompts of {args.input_len} tokens, outputs of "
          f"{args.output_len}, {args.low:g} <-> {args.high:g} req/s every {args.period:g} s for {args.duration:g} s "
          f"(average {report['average_rate']:g}, {report['num_requests']} requests); SLO TTFT {MIX_SLO['ttft']:g} ms, "
          f"mean ITL {MIX_SLO['tpot']:g} ms; up to "
          f"{args.max_total_replicas} replicas of {args.max_num_seqs} sequences\n")
    print("| setup | SLO attainment (sim) | per step | p99 TTFT ms (sim) | p99 ITL ms (sim) "
          "| replica-seconds, prefill + decode (sim) |")
    print("|---|---|---|---|---|---|")
    for setup, run in report["runs"].items():
        real, sim = run["real"], run["sim"]
        rs, srs = real["replica_seconds"], sim["replica_seconds"]
        name = SETUP_NAMES[setup] + (f" {run['split'][0]} + {run['split'][1]}" if run["split"] else "")
        print(f"| {name} | {real['slo_attainment']:.3f} ({sim['slo_attainment']:.3f}) | "
              f"{', '.join(f'{a:.2f}' if a is not None else '-' for a in real['step_attainment'])} | "
              f"{real['p99_ttft_ms']:.0f} ({sim['p99_ttft_ms']:.0f}) | {real['p99_itl_ms']:.0f} "
              f"({sim['p99_itl_ms']:.0f}) | {rs['total']:.0f} = {rs['prefill']:.0f} + {rs['decode']:.0f} "
              f"({srs['total']:.0f}) |")
    for setup, run in report["runs"].items():
        if run["split"] is None:
            changes = [f"{t:g} s: {p} + {d}" for i, (t, p, d) in enumerate(run["real"]["timeline"])
                       if i == 0 or (p, d) != tuple(run["real"]["timeline"][i - 1][1:])]
            print(f"\n{SETUP_NAMES[setup]}, replicas (prefill + decode) from the first request: {'; '.join(changes)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
