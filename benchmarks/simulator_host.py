"""What the real app costs on this machine outside its engines' steps: the simulator's `Host`
(pdserve.simulate.hardware), which `pdserve simulate --this-machine` reads.

    python benchmarks/simulator_host.py            # measure and print (3 rounds, ~12 minutes)
    python benchmarks/simulator_host.py --write    # and store it as platform/simulate/cpu_host.json

One request at a time (no queueing, nothing beside it), greedy, ignore_eos: short prompts
(64-128 tokens) with 2 and with 48 output tokens, long ones (1,000-1,100 tokens) with 2, and
prompts of a 1,000-token prefix the replicas hold cached (sent once before) and a 32-96 token
question, with 2, through:
- the offline engine in this process (one thread, as a one-core replica): the engines' own time;
- the colocated app (one replica of one core, one engine thread): the local path;
- the disaggregated app as Serving part 2 deploys it (a prefill and a decode replica of one core
  each), every prompt prefilled remotely: the remote path.
Latency: a path's median TTFT over the offline engine's for the same requests, at the short and
the long prompts: a cost per request and one per prompt token computed (`local_path_s`,
`remote_path_s`, `local_path_s_per_prompt_token`, `remote_path_s_per_prompt_token`: the app's
prefill runs slower than the engine alone, and tokenizing, the KV pull, the join grow with the
prompt), and at the cached prompts, one per prompt token found cached (`..._per_cached_token`:
what is left of those once the prefill skips it). CPU, in the disaggregated app at 2 and 48
output tokens: each replica process's CPU seconds (/proc/PID/stat) less what it uses idle over
the run's length and less its engine's steps as the cpu profile times them
(cpu_calibration.json) is that replica's own Python (`decode_request_s`, `prefill_request_s`,
per prompt token from the long prompts: `decode_s_per_prompt_token`,
`prefill_s_per_prompt_token`, and per cached token from the cached ones); the machine's busy
CPU seconds (/proc/stat) less its idle load and less both replica processes' is the rest of the path (HAProxy, the
gateway, Ray's daemons, and the benchmark's own client, which the real runs also put on these
cores). How much of the decode replica's Python holds up its steps (it shares the GIL with the
engine thread) is read from the gaps: the median gap over the cpu profile's step, one stream at a
time and 8 streams at once (8 requests of 256 tokens), fitted as a cost per step and one per
stream (`decode_step_s`, `decode_token_s`); how the one stream's gaps spread about their median
(`decode_step_jitter_s`, its percentiles: the host's noise, which makes the tail of the gaps);
and what a request joining the batch adds to the step it joins in (`decode_join_s`: a stream of
1,000 tokens with the short prompts sent one after another beside it, the two gaps of the
stream around each one's first token over two of its gaps elsewhere). What of the decode
replica's per-token and per-request CPU that leaves runs beside the engine and joins the rest
as cores taken (`request_cpu_s`, `token_cpu_s`; the simulator spends a request's beside its
join). `idle_cores`: the
machine's busy cores with the app deployed and nothing sent. `cores`: what the machine's cores
give two engines at once: its core count over how much slower a one-thread engine's prefill runs
while another process decodes (two engines share caches and memory bandwidth even on cores of
their own), measured in each round before its apps start. Every figure is the median of the
rounds'.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from machine import machine_line  # this folder's scripts run with it on sys.path
from serving import PRESET, _free_port, _start_ray, _stream_all

# name -> (prompt tokens, output tokens), each `--requests` requests sent one at a time; "cached": a
# CACHED_PREFIX-token prefix every prompt shares (sent once before) and a question of these lengths
WORKLOADS = {"short": ("64:128", 2), "stream": ("64:128", 48), "long": ("1000:1100", 2), "cached": ("32:96", 2)}
CACHED_PREFIX = 1000
BATCH, BATCH_OUTPUT = 8, 256  # the run whose gaps are 8 streams' steps
JOIN_STREAM_OUTPUT = 1000  # the stream the short prompts join beside, one after another
JITTER_PERCENTILES = [i + 0.5 for i in range(100)]  # of the one stream's gaps about their median
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


# A one-thread engine decoding 8 streams of 100-token prompts until killed, in a process of its own.
DECODE_LOOP = """
import sys
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
engine = LLM(sys.argv[1], num_threads=1, max_num_seqs=64).engine
vocab, k = engine.tokenizer.vocab_size, 0
while True:
    while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 8:
        k += 1
        engine.add_request(f"d{k}", [5 + (7919 * k + 31 * t) % (vocab - 5) for t in range(100)],
                           SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    engine.step()
    if k == 8:
        print("decoding", flush=True)
"""


def co_running_slowdown(model: str, repeats: int = 5) -> dict:
    """A 1,024-token prefill's median time beside a decoding engine over its median time alone
    (both one thread, each in its own process), taking turns: alone, beside, alone, ..."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLM(model, num_threads=1, max_num_seqs=64).engine
    vocab, serial = engine.tokenizer.vocab_size, [0]

    def prefill_s() -> float:
        serial[0] += 1
        engine.add_request(f"p{serial[0]}", [5 + (7919 * serial[0] + 31 * t) % (vocab - 5) for t in range(1024)],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    prefill_s()  # warm-up
    times: dict[str, list[float]] = {"alone": [], "beside": []}
    for _ in range(repeats):
        times["alone"].append(prefill_s())
        decoder = subprocess.Popen([sys.executable, "-c", DECODE_LOOP, model], stdout=subprocess.PIPE, text=True)
        try:
            decoder.stdout.readline()  # decoding
            times["beside"].append(prefill_s())
        finally:
            decoder.kill()
            decoder.wait()
    engine.shutdown()
    return {"slowdown": statistics.median(times["beside"]) / statistics.median(times["alone"]),
            "prefill_s": times}


def step_cost(model: str):
    from pdserve.simulate.hardware import load_cpu
    from pdserve.simulate.model import load_model
    from pdserve.simulate.roofline import StepCost

    return StepCost(load_model(model), load_cpu())


def engine_seconds(cost, reqs, cached: list[int]) -> tuple[float, float]:
    """(prefill, decode) seconds the engine's steps take for `reqs` one at a time, as the cpu
    profile (`cost`, a StepCost) times them: a prompt's one prefill step after its `cached`
    tokens, then a decode step per later token."""
    from pdserve.simulate.roofline import prefill_pairs

    prefill = decode = 0.0
    for r, c in zip(reqs, cached):
        p = len(r.prompt_token_ids)
        prefill += cost.seconds(p - c, p, prefill_pairs(c, p - c))
        decode += sum(cost.seconds(1, p + k, p + k) for k in range(1, r.max_tokens))
    return prefill, decode


def cached_tokens(reqs: list, primer, block_size: int) -> list[int]:
    """What the prefix cache holds of each prompt after `primer` (None: nothing): the whole blocks
    of its common start with the primer's, less its last token (always computed)."""
    out = []
    for r in reqs:
        p, same = r.prompt_token_ids, 0
        if primer is not None:
            for a, b in zip(p, primer.prompt_token_ids):
                if a != b:
                    break
                same += 1
        out.append(min(same // block_size * block_size, len(p) - 1))
    return out


def offline(model: str, workloads: dict[str, list], warmups: list) -> dict:
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
        run(warmups)
        return {n: timed(lambda: run(reqs))[0] for n, reqs in workloads.items()}
    finally:
        engine.shutdown()


def bench(reqs: list, settings, builder) -> dict:
    """A benchmark run's metrics, and its `records` (each request's token arrival times)."""
    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.runner import run_on_client_loop, run_requests

    records, duration, _ = run_on_client_loop(run_requests(reqs, settings, builder, progress=False))
    return {**compute_metrics(records, duration), "records": records}


def served(config, workloads: dict[str, list], builder, warmups: list, idle_s: float, batch: list | None = None,
           joins: list | None = None) -> dict:
    """Deploy `config`; measure its idle load, then each workload one request at a time (CPU by
    the machine and by each engine replica's process), then `batch` all at once, then `joins`
    two at a time (its first request a long stream: the others join beside it one by one)."""
    from ray import serve

    from pdserve.app import build
    from pdserve.bench.runner import RunSettings
    from pdserve.bench.soak import replica_stats

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(config), name=config.name, route_prefix="/")
    try:
        settings = RunSettings(base_url=f"http://127.0.0.1:{port}", concurrency=1)
        bench(warmups, settings, builder)
        pools = ("Prefill", "Decode") if config.mode == "disaggregated" else ("Unified",)
        pids = {pool: replica_stats(config.name, pool, num_calls=1)[0]["pid"] for pool in pools}
        out = {"idle": idle(idle_s, pids)}
        for n, reqs in workloads.items():
            out[n] = timed(lambda: bench(reqs, settings, builder), pids)
        if batch:
            out["batch"] = bench(batch, RunSettings(base_url=settings.base_url, concurrency=len(batch)), builder)
        if joins:
            out["joins"] = bench(joins, RunSettings(base_url=settings.base_url, concurrency=2), builder)
        return out
    finally:
        serve.shutdown()


def join_s(records: list) -> float:
    """What a request joining the batch adds to the step it joins in: the longest stream's two
    gaps around each other request's first token (the step it joined in may end in either), less
    two of its mean gap away from any first token; the mean over the requests that joined while
    it streamed."""
    stream = max(records, key=lambda r: len(r.chunk_times_s))
    t = stream.chunk_times_s
    gaps = [b - a for a, b in zip(t, t[1:])]
    around = [bisect.bisect_left(t, r.chunk_times_s[0]) - 1 for r in records
              if r is not stream and r.ok and t[0] < r.chunk_times_s[0] < t[-2]]  # gap i: t[i] -> t[i + 1]
    if not around:
        raise RuntimeError("no request joined beside the long stream: too few requests, or it ended first")
    near = {j for i in around for j in (i, i + 1)}
    away = statistics.mean(g for i, g in enumerate(gaps) if i not in near)
    return statistics.mean(gaps[i] + gaps[i + 1] - 2 * away for i in around)


def jitter_s(records: list) -> list[float]:
    """The gaps' percentiles (JITTER_PERCENTILES) less their median."""
    import numpy as np

    gaps = [g for r in records if r.ok for g in r.itls_s]
    median = statistics.median(gaps)
    return [float(q) - median for q in np.percentile(gaps, JITTER_PERCENTILES)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per workload (default %(default)s)")
    ap.add_argument("--idle-s", type=float, default=10.0, help="how long each app's idle load is measured")
    ap.add_argument("--rounds", type=int, default=3, help="measure this many times and keep each figure's "
                                                          "median (default %(default)s)")
    ap.add_argument("--write", action="store_true", help=f"store the result as {HOST_FILE.name}")
    args = ap.parse_args()

    rounds = [measure(args) for _ in tqdm(range(args.rounds), desc="rounds")]

    def median(values: list):  # of numbers, or of lists elementwise
        return [statistics.median(v) for v in zip(*values)] if isinstance(values[0], list) \
            else statistics.median(values)

    host = {k: median([r["host"][k] for r in rounds]) for k in rounds[0]["host"]}
    host["source"] = (f"benchmarks/simulator_host.py, {PRESET}, {args.requests} requests per workload, median of "
                      f"{args.rounds} rounds")
    report = {"machine": machine_line(), "load_average": os.getloadavg(),
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": host,
              "rounds": rounds}
    print(json.dumps(report, indent=1))
    if args.write:
        HOST_FILE.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {HOST_FILE}")


def measure(args) -> dict:
    """One round: every workload through the offline engine and both apps; the `Host` it gives."""
    import ray

    from pdserve.bench.workloads import PromptBuilder, random_workload, shared_prefix_workload
    from pdserve.config import EngineConfig, ServeConfig
    from pdserve.engine.checkpoint import default_model

    model = str(default_model(PRESET))
    builder = PromptBuilder(model)
    workloads = {name: random_workload(builder, args.requests, prompt, str(out), seed=seed)
                 for seed, (name, (prompt, out)) in enumerate(WORKLOADS.items()) if name != "cached"}
    primer, *workloads["cached"] = shared_prefix_workload(builder, args.requests + 1, 1, CACHED_PREFIX,
                                                          WORKLOADS["cached"][0], str(WORKLOADS["cached"][1]), seed=3)
    cached = {w: cached_tokens(reqs, primer if w == "cached" else None, EngineConfig.model_fields["block_size"].default)
              for w, reqs in workloads.items()}
    # One request, so first-call costs stay out of the figures; then the cached prompts' prefix.
    warmups = [random_workload(builder, 1, "128", "8", seed=1000)[0], primer]
    batch = random_workload(builder, BATCH, "64:128", str(BATCH_OUTPUT), seed=BATCH_OUTPUT)
    joins = random_workload(builder, 1, "64:128", str(JOIN_STREAM_OUTPUT), seed=JOIN_STREAM_OUTPUT) \
        + workloads["short"]
    engine = {"num_threads": 1, "max_num_seqs": 64, "split_prompts_to_fill_steps": False}
    one_core = {"ray_actor_options": {"num_cpus": 1}, "engine": {"num_threads": 1}}
    colocated = ServeConfig(name="colocated", model=model, engine=engine, mode="colocated", decode=one_core)
    # Every prompt remote, as Serving part 2's disaggregated setups (a TTFT target the prefill pool always meets).
    disagg = ServeConfig(name="disagg", model=model, engine=engine, prefill=one_core, decode=one_core,
                         slo={"ttft_ms": 3_600_000}, transfer={"host": "127.0.0.1"})

    co_running = co_running_slowdown(model)  # before Ray starts: nothing else running
    _start_ray(model, "haproxy")
    try:
        alone = offline(model, workloads, warmups)
        apps = {"local": served(colocated, workloads, builder, warmups, args.idle_s),
                "remote": served(disagg, workloads, builder, warmups, args.idle_s, batch, joins)}
    finally:
        ray.shutdown()
    metrics = {"offline": alone, **{name: {w: app[w][0] for w in WORKLOADS} for name, app in apps.items()}}
    remote = apps["remote"]

    def prompt_len(w: str) -> float:
        """Its prompts' mean tokens computed (not found cached)."""
        return statistics.mean(len(r.prompt_token_ids) - c for r, c in zip(workloads[w], cached[w]))

    def by_prompt_tokens(extra: dict) -> tuple[float, float, float]:
        """(a request's, a prompt token computed, one found cached) of a cost by workload: short
        and long prompts give the first two, the cached prompts the third."""
        computed = max(0.0, (extra["long"] - extra["short"]) / (prompt_len("long") - prompt_len("short")))
        found = max(0.0, (extra["cached"] - extra["short"] - computed * (prompt_len("cached") - prompt_len("short")))
                    / statistics.mean(cached["cached"]))
        return extra["short"] - computed * prompt_len("short"), computed, found

    def path_s(app: str) -> tuple[float, float, float]:
        """The app's TTFT over the engine's: (a request's, a prompt token computed, one cached)."""
        return by_prompt_tokens({w: (metrics[app][w]["median_ttft_ms"] - alone[w]["median_ttft_ms"]) / 1000
                          for w in ("short", "long", "cached")})

    cost = step_cost(model)
    engine_s = {w: dict(zip(("Prefill", "Decode"), engine_seconds(cost, reqs, cached[w])))
                for w, reqs in workloads.items()}

    def own_s(w: str) -> dict:
        """Per request of workload `w`: each replica's CPU beyond its engine's steps and its idle
        load, and the machine's beyond both processes and its idle load."""
        _, cpu, wall = remote[w]
        busy = {k: v - remote["idle"][k] * wall for k, v in cpu.items()}
        out = {pool: (busy[pool] - engine_s[w][pool]) / args.requests for pool in ("Prefill", "Decode")}
        out["rest"] = (busy["machine"] - busy["Prefill"] - busy["Decode"]) / args.requests
        return out

    tokens = {w: WORKLOADS[w][1] for w in WORKLOADS}
    per_token = {k: max(0.0, (own_s("stream")[k] - own_s("short")[k]) / (tokens["stream"] - tokens["short"]))
                 for k in ("Decode", "rest")}
    # Each replica's own Python a prompt token (hashing its blocks, exporting or pulling its KV):
    # computed, long against short; found cached, from the cached prompts.
    own_by_pool = {pool: by_prompt_tokens({w: own_s(w)[pool] for w in ("short", "long", "cached")})
                   for pool in ("Prefill", "Decode")}
    per_prompt_token = {pool: own[1] for pool, own in own_by_pool.items()}
    per_request = {k: max(0.0, own_s("short")[k] - tokens["short"] * per_token[k]
                          - prompt_len("short") * per_prompt_token.get(k, 0.0)) for k in ("Decode", "rest")}
    # The decode steps' gaps over the profile's steps, at 1 and at BATCH streams (contexts at mid-stream).
    def gap_over_step_s(m: dict, reqs: list, streams: int) -> float:
        context = statistics.mean(len(r.prompt_token_ids) + r.max_tokens / 2 for r in reqs)
        return m["median_itl_ms"] / 1000 - cost.seconds(streams, streams * context, streams * context)

    one = gap_over_step_s(metrics["remote"]["stream"], workloads["stream"], 1)
    many = gap_over_step_s(remote["batch"], batch, BATCH)
    decode_token_s = max(0.0, (many - one) / (BATCH - 1))
    decode_step_s = max(0.0, one - decode_token_s)
    beside = max(0.0, per_token["Decode"] - decode_step_s - decode_token_s)  # a token's decode CPU off the step
    (local_s, local_per_token, local_per_cached), (remote_s, remote_per_token, remote_per_cached) = \
        path_s("local"), path_s("remote")
    host = {"cores": os.cpu_count() / max(1.0, co_running["slowdown"]), "idle_cores": remote["idle"]["machine"],
            "request_cpu_s": per_request["rest"], "token_cpu_s": per_token["rest"] + beside,
            "decode_request_s": per_request["Decode"], "decode_step_s": decode_step_s, "decode_token_s": decode_token_s,
            "decode_step_jitter_s": jitter_s(remote["stream"][0]["records"]),
            "decode_join_s": max(0.0, join_s(remote["joins"]["records"])),
            "decode_s_per_prompt_token": per_prompt_token["Decode"],
            "decode_s_per_cached_token": own_by_pool["Decode"][2],
            "prefill_request_s": max(0.0, statistics.mean(own_s(w)["Prefill"] for w in ("short", "stream"))
                                     - prompt_len("short") * per_prompt_token["Prefill"]),
            "prefill_s_per_prompt_token": per_prompt_token["Prefill"],
            "prefill_s_per_cached_token": own_by_pool["Prefill"][2],
            "local_path_s": local_s, "remote_path_s": remote_s, "local_path_s_per_prompt_token": local_per_token,
            "remote_path_s_per_prompt_token": remote_per_token, "local_path_s_per_cached_token": local_per_cached,
            "remote_path_s_per_cached_token": remote_per_cached}
    return {"load_average": os.getloadavg(), "host": host,
            "mean_prompt_tokens": {w: prompt_len(w) + statistics.mean(cached[w]) for w in WORKLOADS},
            "mean_cached_tokens": {w: statistics.mean(cached[w]) for w in WORKLOADS},
            "median_ttft_ms": {name: {w: m[w]["median_ttft_ms"] for w in WORKLOADS} for name, m in metrics.items()},
            "median_itl_ms": {name: {w: m[w]["median_itl_ms"] for w in WORKLOADS} for name, m in metrics.items()},
            f"median_itl_ms_{BATCH}_streams": remote["batch"]["median_itl_ms"],
            "gap_over_step_ms": {1: one * 1000, BATCH: many * 1000},
            "own_cpu_s_per_request": {w: own_s(w) for w in WORKLOADS},
            "engine_s_per_request": {w: {k: v / args.requests for k, v in engine_s[w].items()} for w in engine_s},
            "idle_cores": {name: app["idle"] for name, app in apps.items()}, "co_running": co_running}


if __name__ == "__main__":
    main()
