"""What the real app costs on this machine outside its engines' steps: the simulator's `Host`
(pdserve.simulate.hardware), which `pdserve simulate --this-machine` reads.

    python benchmarks/simulator_host.py            # measure and print
    python benchmarks/simulator_host.py --write    # and store it as platform/simulate/cpu_host.json

One request at a time (no queueing, nothing beside it), the same short prompts (64-128 tokens,
greedy, ignore_eos) with 2 and then 48 output tokens, through:
- the offline engine in this process (one thread, as a one-core replica): the engines' own time;
- the colocated app (one replica of one core, one engine thread): the local path;
- the disaggregated app as Serving part 2 deploys it (a prefill and a decode replica of one core
  each), every prompt prefilled remotely: the remote path.
Latency: a path's median TTFT over the offline engine's for the same requests (`local_path_s`,
`remote_path_s`). CPU, in the disaggregated app: each replica process's CPU seconds
(/proc/PID/stat) less what it uses idle over the run's length and less its engine's steps as the
cpu profile times them (cpu_calibration.json) is that replica's own Python (`decode_request_s`,
`prefill_request_s`); the machine's busy CPU seconds (/proc/stat) less its idle load and less both
replica processes' is the rest of the path (`request_cpu_s`, `token_cpu_s`: HAProxy, the gateway,
Ray's daemons, and the benchmark's own client, which the real runs also put on these cores). Per
request and per token from the runs at 2 and at 48 output tokens. How much of the decode replica's
Python holds up its steps (it shares the GIL with the engine thread; the rest runs beside it) is
read from the gaps instead: the median gap over the cpu profile's step, one stream at a time and
8 streams at once (8 requests of 256 tokens), fitted as a cost per step and one per stream
(`decode_step_s`, `decode_token_s`). `idle_cores`: the machine's busy cores with the app deployed
and nothing sent; `cores`: its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from machine import machine_line  # this folder's scripts run with it on sys.path
from serving import PRESET, _free_port, _start_ray, _stream_all

OUTPUTS = (2, 48)
BATCH, BATCH_OUTPUT = 8, 256  # the run whose gaps are 8 streams' steps
HOST_FILE = Path(__file__).parents[1] / "platform" / "simulate" / "cpu_host.json"


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def timed(run, pids: dict[str, int] | None = None) -> tuple[dict, dict, float]:
    """(run's metrics, CPU seconds it took: the machine's and each of `pids`', its wall seconds)."""
    def cpu() -> dict:
        return {"machine": busy_cpu_s(), **{name: process_cpu_s(pid) for name, pid in (pids or {}).items()}}

    before, t = cpu(), time.perf_counter()
    result = run()
    after = cpu()
    return result, {k: after[k] - before[k] for k in before}, time.perf_counter() - t


def idle(seconds: float, pids: dict[str, int] | None = None) -> dict:
    """Cores busy while nothing is sent: the machine's and each of `pids`'."""
    _, cpu, wall = timed(lambda: time.sleep(seconds), pids)
    return {k: v / wall for k, v in cpu.items()}


def step_cost(model: str):
    from pdserve.simulate.hardware import load_cpu
    from pdserve.simulate.model import load_model
    from pdserve.simulate.roofline import StepCost

    return StepCost(load_model(model), load_cpu())


def engine_seconds(model: str, reqs) -> tuple[float, float]:
    """(prefill, decode) seconds the engine's steps take for `reqs` one at a time, as the cpu
    profile times them: a prompt's one prefill step, then a decode step per later token."""
    from pdserve.simulate.roofline import prefill_pairs

    cost = step_cost(model)
    prefill = decode = 0.0
    for r in reqs:
        p = len(r.prompt_token_ids)
        prefill += cost.seconds(p, p, prefill_pairs(0, p))
        decode += sum(cost.seconds(1, p + k, p + k) for k in range(1, r.max_tokens))
    return prefill, decode


def offline(model: str, workloads: dict[int, list], warmup) -> dict:
    """The engine alone, in this process, one request at a time: each workload timed without the
    engine's start and shutdown."""
    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.runner import run_on_client_loop
    from pdserve.config import EngineConfig
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, num_threads=1)))

    async def open_stream(i, r, params):
        return await engine.generate(f"b{time.monotonic_ns()}", r.prompt_token_ids, params)

    def run(reqs):
        return compute_metrics(*run_on_client_loop(_stream_all(reqs, 1, open_stream)))

    try:
        run([warmup])
        return {n: timed(lambda: run(reqs))[0] for n, reqs in workloads.items()}
    finally:
        engine.shutdown()


def served(config, workloads: dict[int, list], builder, warmup, idle_s: float, batch: list | None = None) -> dict:
    """Deploy `config`; measure its idle load, then each workload one request at a time (CPU by
    the machine and by each engine replica's process), then `batch` all at once."""
    from ray import serve

    from pdserve.app import build
    from pdserve.bench.runner import RunSettings, run_benchmark
    from pdserve.bench.soak import replica_stats

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(config), name=config.name, route_prefix="/")
    try:
        settings = RunSettings(base_url=f"http://127.0.0.1:{port}", concurrency=1)
        run_benchmark([warmup], settings, builder, progress=False)
        pools = ("Prefill", "Decode") if config.mode == "disaggregated" else ("Unified",)
        pids = {pool: replica_stats(config.name, pool, num_calls=1)[0]["pid"] for pool in pools}
        out = {"idle": idle(idle_s, pids)}
        for n, reqs in workloads.items():
            out[n] = timed(lambda: run_benchmark(reqs, settings, builder, progress=False), pids)
        if batch:
            out["batch"] = run_benchmark(batch, RunSettings(base_url=settings.base_url, concurrency=len(batch)),
                                         builder, progress=False)
        return out
    finally:
        serve.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per output length (default %(default)s)")
    ap.add_argument("--idle-s", type=float, default=10.0, help="how long each app's idle load is measured")
    ap.add_argument("--write", action="store_true", help=f"store the result as {HOST_FILE.name}")
    args = ap.parse_args()

    import ray

    from pdserve.bench.workloads import PromptBuilder, random_workload
    from pdserve.config import ServeConfig
    from pdserve.engine.checkpoint import default_model

    model = str(default_model(PRESET))
    builder = PromptBuilder(model)
    workloads = {n: random_workload(builder, args.requests, "64:128", str(n), seed=n) for n in OUTPUTS}
    warmup = random_workload(builder, 1, "128", "8", seed=1000)[0]
    batch = random_workload(builder, BATCH, "64:128", str(BATCH_OUTPUT), seed=BATCH_OUTPUT)
    engine = {"num_threads": 1, "max_num_seqs": 64, "split_prompts_to_fill_steps": False}
    one_core = {"ray_actor_options": {"num_cpus": 1}, "engine": {"num_threads": 1}}
    colocated = ServeConfig(name="colocated", model=model, engine=engine, mode="colocated", decode=one_core)
    # Every prompt remote, as Serving part 2's disaggregated setups (a TTFT target the prefill pool always meets).
    disagg = ServeConfig(name="disagg", model=model, engine=engine, prefill=one_core, decode=one_core,
                         slo={"ttft_ms": 3_600_000}, transfer={"host": "127.0.0.1"})

    _start_ray(model, "haproxy")
    try:
        alone = offline(model, workloads, warmup)
        apps = {"local": served(colocated, workloads, builder, warmup, args.idle_s),
                "remote": served(disagg, workloads, builder, warmup, args.idle_s, batch)}
    finally:
        ray.shutdown()

    def ttft_s(metrics: dict) -> float:  # output length -> metrics
        return statistics.median([metrics[n]["median_ttft_ms"] for n in OUTPUTS]) / 1000

    remote = apps["remote"]
    engine_s = {n: dict(zip(("Prefill", "Decode"), engine_seconds(model, reqs))) for n, reqs in workloads.items()}

    def own_s(n: int) -> dict:
        """Per request at `n` output tokens: each replica's CPU beyond its engine's steps and its
        idle load, and the machine's beyond both processes and its idle load."""
        _, cpu, wall = remote[n]
        busy = {k: v - remote["idle"][k] * wall for k, v in cpu.items()}
        out = {pool: (busy[pool] - engine_s[n][pool]) / args.requests for pool in ("Prefill", "Decode")}
        out["rest"] = (busy["machine"] - busy["Prefill"] - busy["Decode"]) / args.requests
        return out

    short, long_ = OUTPUTS
    per_token = {k: max(0.0, (own_s(long_)[k] - own_s(short)[k]) / (long_ - short)) for k in ("Decode", "rest")}
    per_request = {k: max(0.0, own_s(short)[k] - short * per_token.get(k, 0.0)) for k in ("Decode", "rest")}
    # The decode steps' gaps over the profile's steps, at 1 and at BATCH streams (contexts at mid-stream).
    cost = step_cost(model)

    def gap_over_step_s(metrics: dict, reqs: list, streams: int) -> float:
        context = statistics.mean(len(r.prompt_token_ids) + r.max_tokens / 2 for r in reqs)
        return metrics["median_itl_ms"] / 1000 - cost.seconds(streams, streams * context, streams * context)

    one = gap_over_step_s(remote[long_][0], workloads[long_], 1)
    many = gap_over_step_s(remote["batch"], batch, BATCH)
    decode_token_s = max(0.0, (many - one) / (BATCH - 1))
    host = {"cores": os.cpu_count(), "idle_cores": remote["idle"]["machine"],
            "request_cpu_s": per_request["rest"], "token_cpu_s": per_token["rest"],
            "decode_request_s": per_request["Decode"], "decode_step_s": max(0.0, one - decode_token_s),
            "decode_token_s": decode_token_s,
            "prefill_request_s": max(0.0, statistics.mean(own_s(n)["Prefill"] for n in OUTPUTS)),
            "local_path_s": ttft_s({n: apps["local"][n][0] for n in OUTPUTS}) - ttft_s(alone),
            "remote_path_s": ttft_s({n: remote[n][0] for n in OUTPUTS}) - ttft_s(alone),
            "source": f"benchmarks/simulator_host.py, {PRESET}, {args.requests} requests per output length"}
    served_metrics = {name: {n: app[n][0] for n in OUTPUTS} for name, app in apps.items()}
    report = {"machine": machine_line(), "load_average": os.getloadavg(),
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": host,
              "median_ttft_ms": {name: {n: m[n]["median_ttft_ms"] for n in OUTPUTS}
                                 for name, m in (("offline", alone), *served_metrics.items())},
              "median_itl_ms": {name: {n: m[n]["median_itl_ms"] for n in OUTPUTS}
                                for name, m in (("offline", alone), *served_metrics.items())},
              f"median_itl_ms_{BATCH}_streams": remote["batch"]["median_itl_ms"],
              "gap_over_step_ms": {1: one * 1000, BATCH: many * 1000},
              "own_cpu_s_per_request": {n: own_s(n) for n in OUTPUTS},
              "engine_s_per_request": {n: {k: v / args.requests for k, v in engine_s[n].items()} for n in OUTPUTS},
              "idle_cores": {name: app["idle"] for name, app in apps.items()}}
    print(json.dumps(report, indent=1))
    if args.write:
        HOST_FILE.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {HOST_FILE}")


if __name__ == "__main__":
    main()
