"""Serving benchmark: what the gateway and Ray hops cost, and what disaggregation buys, in one run.

    python benchmarks/serving.py            # full run (~10 minutes on 2 cores)
    python benchmarks/serving.py --quick    # smaller counts, for a smoke check
    python benchmarks/serving.py --part 1 --concurrency 8 --setups offline,colocated --rounds 2
                                            # only the hop cost at concurrency 8, offline and colocated
                                            # alternating twice (side by side, one run)
    python benchmarks/serving.py --part 1 --concurrency 8 --setups offline,handle,colocated --rounds 3
                                            # and the Ray hop alone (no gateway, no HTTP) between them
    python benchmarks/serving.py --part 1 --concurrency 8 --setups offline,handle,colocated --rounds 3 \
        --engine-threads 1                  # the same with one engine thread: the stack gets a core of its own
    python benchmarks/serving.py --part 2 --rates 3,4.5 --seeds 1,2,3
                                            # only disaggregation's effect: two rates, three draws of the mix
    python benchmarks/serving.py --part 1 --concurrency 8 --setups offline,handle,colocated --rounds 3 \
        --device cuda:0                     # part 1 with the engines on a GPU (benchmarks/gpu_serving.sh)

Part 1, hops: TTFT, ITL and throughput at concurrency 1, 8 and 32 (`--waves` x concurrency
random prompts, fixed output length, greedy, ignore_eos) for the offline engine (AsyncLLMEngine
streams in this process, no HTTP), the colocated app read through the gateway's pool client in
this process (`handle`: the Ray hop alone, no gateway, no HTTP), the colocated app (one Unified
replica) and the disaggregated app (Prefill + Decode), all through `pdserve bench`'s runner for
the served ones.
HTTP comes in as `pdserve serve` takes it: HAProxy in front of the gateway replica (`--ingress
proxy`: Ray Serve's Python proxy).

Part 2, interference: the long-prompt mix of `pdserve bench` (mostly short chats, some long
prompts) at the same Poisson rate against disaggregated pools (prefill and decode replicas one
core each): every prompt prefilled remotely (a latency target the prefill pool always meets; the
decode replica copies the KV blocks out of the prefill replica's cache in shared memory), the same
with the blocks sent over UCX instead (`transfer.shared_memory: false`, as between hosts), the
same placing each prompt against the benchmark's own SLO (`slo`: 4 s TTFT, 150 ms ITL; the
decode replica prefills a prompt itself when the prefill pool would miss the TTFT target), and
colocated serving (one replica, both cores): p99 ITL, TTFT and goodput, at each of `--rates`
(`--mix-setups` picks). At light load few decodes run while a long prompt prefills, so colocated
serving's stalls stay under its 1% tail; disaggregation shows from the load where they do not.
Over several rates, each setup's max goodput is DistServe's: the highest rate at which
`--attainment` of the requests met the SLO.

`--baseline-tree DIR` adds the setup tuned by hand before `slo` replaced the token thresholds (a
worktree of 02a3da7: remote prefill always, local prefill when 1,536 tokens wait on the prefill
replica, for prompts past 256 tokens only behind 3,072, 2 s of pause, 128-token chunks), run by
that tree's pdserve in a child process, draw by draw between this tree's setups.

Model: the `serve-llama-40m` preset (bench-llama-56m's shape with the vocabulary cut to its
tokenizer's; fp32), generated into the pdserve cache on first use. About a sixth of its greedy
tokens have no text of their own (byte pieces of an unfinished character, `<unk>`, `</s>`): each
still streams as a chunk, and every chunk is timed.
Prints markdown tables and one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, is_dataclass
from functools import partial

from machine import machine_line, warn_if_pinned  # this folder's scripts run with it on sys.path

PRESET = "serve-llama-40m"
SETUPS = ("offline", "handle", "colocated", "disaggregated")
# Part 2's setups by short name (--mix-setups), as its tables name them; colocated is always run.
MIX_SETUPS = {"disaggregated": "disaggregated", "ucx": "disaggregated, blocks over UCX",
              "slo": "disaggregated, placed by the SLO", "colocated": "colocated"}
BASELINE = "tuned thresholds (baseline tree)"
# The SLO of part 2's mix: goodput counts requests within both.
MIX_SLO = {"ttft": 4000.0, "tpot": 150.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream_all(requests, concurrency: int, open_stream) -> tuple[list, float]:
    """Every request's output stream, at most `concurrency` at once, recorded for the metrics;
    `await open_stream(i, request, params)` gives request i's async iterator of outputs.
    Returns (records, elapsed seconds)."""
    from pdserve.bench.metrics import RequestRecord
    from pdserve.engine.sampling_params import SamplingParams

    sem, records = asyncio.Semaphore(concurrency), []

    async def one(i, r):
        async with sem:
            rec = RequestRecord(send_s=time.perf_counter(), prompt_tokens=len(r.prompt_token_ids))
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            async for out in await open_stream(i, r, params):
                rec.chunk_times_s.append(time.perf_counter())
                rec.output_tokens += len(out.new_token_ids)
            rec.end_s = time.perf_counter()
            records.append(rec)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return records, time.perf_counter() - start


def offline_run(model: str, requests, concurrency: int, num_threads: int, engine_options: dict, warmup) -> dict:
    """The baseline: the same requests as engine streams in this process (after `warmup`, as the
    served setups). `engine_options`: the engine's kv_cache_dtype, weight_dtype, device and enforce_eager."""
    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.runner import run_on_client_loop
    from pdserve.config import EngineConfig
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, num_threads=num_threads, **engine_options)))

    async def open_stream(i, r, params):
        return await engine.generate(f"b{i}", r.prompt_token_ids, params)

    async def main():
        await _stream_all([warmup], 1, open_stream)
        return await _stream_all(requests, concurrency, open_stream)

    try:
        records, duration = run_on_client_loop(main())
    finally:
        engine.shutdown()
    return compute_metrics(records, duration)


def handle_run(config, requests, concurrency: int, warmup) -> dict:
    """The colocated app read without HTTP or the gateway: the gateway's own pool client
    (`PoolsClient`) driven from this process, so only the Ray hop to the engine replica is measured."""
    from ray import serve

    from pdserve.app import build
    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.runner import run_on_client_loop
    from pdserve.gateway.deployment import PoolsClient
    from pdserve.protocol import GenerateRequest

    serve.run(build(config), name=config.name, route_prefix=None)
    client = PoolsClient(serve.get_deployment_handle("Unified", config.name), {})

    async def open_stream(i, r, params):
        return client.generate(GenerateRequest(f"h{i}-{time.monotonic_ns()}", r.prompt_token_ids, params))

    async def main():
        await _stream_all([warmup], 1, open_stream)
        return await _stream_all(requests, concurrency, open_stream)

    try:
        records, duration = run_on_client_loop(main())
    finally:
        serve.shutdown()
    return compute_metrics(records, duration)


def served_runs(config, requests_by_c: dict[int, list], builder, warmup, rate: float | None = None,
                slo: dict | None = None) -> dict:
    """Deploy `config`, run each workload against it (each after `warmup`), tear it down."""
    from ray import serve

    from pdserve.app import build
    from pdserve.bench.runner import RunSettings, run_benchmark

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(config), name=config.name, route_prefix="/")
    try:
        results = {}
        for c, reqs in requests_by_c.items():
            settings = RunSettings(base_url=f"http://127.0.0.1:{port}", concurrency=None if rate else c,
                                   rate=rate or float("inf"), slo=slo, seed=0)
            # Warm-up: one request, so replicas' first-call costs stay out of the figures; not one of
            # the workload's, whose prompt would then be cached.
            run_benchmark([warmup], RunSettings(base_url=settings.base_url, concurrency=1), builder, progress=False)
            result = run_benchmark(reqs, settings, builder, progress=False)
            results[c] = {k: v for k, v in result.items() if k not in ("ttfts_ms", "e2els_ms")}
        if config.mode == "disaggregated":  # where the prompts were prefilled (warm-ups included)
            stats = serve.get_deployment_handle("Decode", config.name).stats.remote().result(timeout_s=30)
            for c in results:  # (what the tree running it counts)
                results[c]["decode_prefills"] = {k: v for k, v in stats.items()
                                                 if k.startswith(("num_remote_prefills", "num_local_prefills"))}
        return results
    finally:
        serve.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller counts for a smoke check")
    ap.add_argument("--part", type=int, choices=(1, 2), help="run only part 1 (hops) or part 2 (interference)")
    ap.add_argument("--rates", help="part 2's Poisson arrival rates in requests/s, comma-separated (default "
                                    "1.5,3,4.5; 1 with --quick): where disaggregation pays depends on the load")
    ap.add_argument("--mix-workload", choices=("long-prompt-mix", "shared-prefix"), default="long-prompt-mix",
                    help="part 2's requests: the long-prompt mix, or 8 tenants' 1,000-token system prompts (Zipf) "
                         "with 32-96-token questions (the simulator's calibration runs both)")
    ap.add_argument("--seeds", default="1", help="part 2: draws of the long-prompt mix, comma-separated seeds "
                                                 "(how many long prompts come, and how close, varies a lot)")
    ap.add_argument("--requests", type=int, help="part 2: requests per draw (default 60; 24 with --quick): the "
                                                 "colocated p99 is only well placed when its prefill stalls are "
                                                 "more than 1%% of its gaps")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="part 2, over several --rates: each setup's max goodput is the highest rate at which this "
                         "share of requests met the SLO (DistServe's definition; default %(default)s)")
    ap.add_argument("--concurrency", help="part 1's concurrencies, comma-separated (default 1,8,32)")
    ap.add_argument("--setups", default=",".join(SETUPS), help="part 1's setups, comma-separated")
    ap.add_argument("--mix-setups", default=",".join(MIX_SETUPS), help="part 2's setups, comma-separated "
                                                                       "(colocated always runs: the others' ratios)")
    ap.add_argument("--rounds", type=int, default=1, help="part 1: run the setups this many times, alternating")
    ap.add_argument("--waves", type=int, help="part 1: requests per setup, in multiples of the concurrency "
                                              "(default 8; 3 with --quick)")
    ap.add_argument("--engine-threads", type=int, default=2,
                    help="part 1: threads of the offline and colocated engines (default 2, both cores; 1 leaves a "
                         "core to the gateway, HAProxy, Ray and the client, as a GPU host's engine leaves its CPUs)")
    ap.add_argument("--ingress", choices=("proxy", "haproxy"), default="haproxy",
                    help="what takes HTTP in front of the gateway replicas: Ray Serve's Python proxy, or "
                         "HAProxy forwarding to the replicas' own servers (direct ingress)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16"), default="auto",
                    help="every setup's KV cache: the model's dtype (fp32), or bf16 (half the bytes attention "
                         "reads and pulls move)")
    ap.add_argument("--device", default="cpu",
                    help="part 1: where the offline and colocated engines compute, e.g. cuda:0 (the colocated "
                         "replica then asks Ray for one GPU); the gateway, Ray and the client stay on the CPUs")
    ap.add_argument("--weight-dtype", choices=("auto", "bfloat16"), default="auto",
                    help="every setup's weight matrices: the model's dtype (fp32), or weight-only bf16 (half the "
                         "bytes a decode step streams)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="part 1 on a GPU: run decode steps op by op instead of replaying CUDA graphs")
    ap.add_argument("--baseline-tree", help="part 2: also run the hand-tuned setup of this pdserve tree (a worktree "
                                            "of 02a3da7, before `slo`), in a child process, draw by draw")
    ap.add_argument("--child-run", help=argparse.SUPPRESS)  # JSON {config, rate, seed, requests}: one served run
    args = ap.parse_args()
    if args.child_run:
        return _child_run(json.loads(args.child_run))
    warn_if_pinned()
    setups = args.setups.split(",")
    if not set(setups) <= set(SETUPS):
        ap.error(f"--setups: choose from {','.join(SETUPS)}")
    if args.device != "cpu" and (args.part != 1 or "disaggregated" in setups):
        ap.error("--device: only part 1's offline, handle and colocated setups run off the CPU")
    from pdserve.bench.metrics import check_attainment

    try:
        check_attainment(args.attainment)
    except ValueError as e:
        ap.error(f"--{e}")
    mix_setups = set(args.mix_setups.split(",")) | {"colocated"}
    if not mix_setups <= set(MIX_SETUPS):
        ap.error(f"--mix-setups: choose from {','.join(MIX_SETUPS)}")

    import ray

    from pdserve.bench.report import max_goodput
    from pdserve.bench.workloads import PromptBuilder, random_workload
    from pdserve.config import ServeConfig
    from pdserve.engine.checkpoint import default_model

    model = str(default_model(PRESET))
    builder = PromptBuilder(model)
    concurrencies = (1, 8) if args.quick else (1, 8, 32)
    if args.concurrency:
        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    out_len = 16 if args.quick else 32
    waves = args.waves or (3 if args.quick else 8)
    requests_by_c = {c: random_workload(builder, max(4, waves * c), "128", str(out_len), seed=c) for c in concurrencies}
    warmup = random_workload(builder, 1, "128", str(out_len), seed=1000)[0]  # every setup's first request

    start_ray = partial(_start_ray, model, args.ingress)
    start_ray()
    # A run stopped by `timeout` (SIGTERM) still shuts Ray down and prints what it measured so far
    # (set after ray.init, which installs a handler of its own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report: dict = {"machine": machine_line(device=args.device), "model": PRESET, "hops": {}, "interference": {},
                    "max_goodput": {}, "attainment": args.attainment}
    try:
        # -- part 1: hops ------------------------------------------------------------------------
        engine_options = {"kv_cache_dtype": args.kv_cache_dtype, "weight_dtype": args.weight_dtype,
                          "device": args.device, "enforce_eager": args.enforce_eager}
        # CPU pools: a step's leftover budget is not filled with the next prompt's first chunk (docs/serving.md).
        engine = {"num_threads": 2, "max_num_seqs": 64, "split_prompts_to_fill_steps": False, **engine_options}
        one_core = {"ray_actor_options": {"num_cpus": 1}, "engine": {"num_threads": 1}}

        def colocated_app(threads: int) -> ServeConfig:  # one replica on both cores, `threads` engine threads
            gpus = {"num_gpus": 1} if args.device.startswith("cuda") else {}
            return ServeConfig(name="colocated", model=model, engine=engine, mode="colocated",
                               decode={"ray_actor_options": {"num_cpus": 2, **gpus}, "engine": {"num_threads": threads}})

        colocated, colocated_hops = colocated_app(2), colocated_app(args.engine_threads)
        # Every prompt remote: a TTFT target (an hour) the prefill pool always meets.
        disagg = ServeConfig(name="disagg", model=model, engine=engine, prefill=one_core, decode=one_core,
                             slo={"ttft_ms": 3_600_000}, transfer={"host": "127.0.0.1"})
        runs = {"offline": lambda: {c: offline_run(model, reqs, c, args.engine_threads, engine_options, warmup)
                                    for c, reqs in requests_by_c.items()},
                "handle": lambda: {c: handle_run(colocated_hops, reqs, c, warmup) for c, reqs in requests_by_c.items()},
                "colocated": lambda: served_runs(colocated_hops, requests_by_c, builder, warmup),
                "disaggregated": lambda: served_runs(disagg, requests_by_c, builder, warmup)}
        for r in range(args.rounds if args.part != 2 else 0):
            for setup in setups:
                report["hops"][setup if args.rounds == 1 else f"{setup} #{r + 1}"] = runs[setup]()
        if args.part == 1:
            return

        # -- part 2: interference -------------------------------------------------------------
        n = args.requests or (24 if args.quick else 60)
        rates = [float(r) for r in (args.rates or ("1" if args.quick else "1.5,3,4.5")).split(",")]
        seeds = [int(x) for x in args.seeds.split(",")]
        over_ucx = disagg.model_copy(update={"transfer": disagg.transfer.model_copy(update={"shared_memory": False})})
        by_slo = ServeConfig.model_validate(disagg.model_dump() | {
            "slo": {"ttft_ms": MIX_SLO["ttft"], "itl_ms": MIX_SLO["tpot"]}})
        setups_2 = {"disaggregated": disagg, "ucx": over_ucx, "slo": by_slo, "colocated": colocated}
        setups_2 = {MIX_SETUPS[name]: cfg for name, cfg in setups_2.items() if name in mix_setups}
        for seed in seeds:
            mix = part2_requests(builder, n, seed, args.mix_workload)
            kind = "mix" if args.mix_workload == "long-prompt-mix" else "shared prefixes"
            draws = [f"{rate} req/s, {kind} seed {seed}" for rate in rates]
            for rate, draw in zip(rates, draws):
                report["interference"][draw] = {name: served_runs(cfg, {0: mix}, builder, warmup, rate, MIX_SLO)[0]
                                                 for name, cfg in setups_2.items()}
                if args.baseline_tree:
                    report["interference"][draw][BASELINE] = _baseline_run(
                        args.baseline_tree, _tuned_config(disagg), rate, seed, n, args.ingress, start_ray)
                print(f"{draw}: " + "; ".join(f"{name} p99 ITL {m['p99_itl_ms']:.0f} ms, {m['slo_attainment']:.3f} "
                                             "within SLO" for name, m in report["interference"][draw].items()),
                      flush=True)  # a long sweep's progress
            if len(rates) > 1:  # DistServe's goodput: the highest of these rates each setup sustains
                report["max_goodput"][f"{kind} seed {seed}"] = {
                    name: max_goodput([report["interference"][d][name] for d in draws], args.attainment)
                    for name in report["interference"][draws[0]]}
    finally:
        ray.shutdown()
        _print(report)


def part2_requests(builder, n: int, seed: int, workload: str) -> list:
    """Part 2's draw: the long-prompt mix (20% of prompts 1,024-1,536 tokens), or shared prefixes."""
    from pdserve.bench.workloads import long_prompt_mix_workload, shared_prefix_workload

    if workload == "shared-prefix":
        return shared_prefix_workload(builder, n, 8, 1000, "32:96", "48", seed=seed)
    return long_prompt_mix_workload(builder, n, "64:128", "1024:1536", "48", 0.2, "16", seed=seed)


def _start_ray(model: str, ingress: str) -> None:
    import ray

    from pdserve.config import ServeConfig
    from pdserve.launch import ray_env

    # As `pdserve serve` starts Ray (gateway.ingress, Serve's control loop): set before Ray starts.
    for name, value in ray_env(ServeConfig(model=model, gateway={"ingress": ingress}), None).items():
        os.environ.setdefault(name, value)
    if ingress == "haproxy":
        # An ingress replica otherwise drains for 30 s (for outside load balancers) when Serve shuts
        # down, past serve.shutdown's own wait: the next setup's serve.run then finds a dying controller.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    os.environ.pop("RAY_ADDRESS", None)  # left by an earlier session's ray.init: start a new one
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"UCX_TLS": "tcp", "TOKENIZERS_PARALLELISM": "false"}})


def _tuned_config(disagg) -> dict:
    """The setup tuned by hand before `slo` (RESULTS.md, #5 part 2, 'long prompts at a longer
    queue'), in the fields of the trees that had them: `disagg` with every prompt remote until
    1,536 uncached tokens wait on the prefill replica; then prompts of up to 256 tokens are
    prefilled on the decode replica (yielding to its decodes for 2 s, then in 128-token chunks),
    longer ones only once 3,072 wait."""
    config = disagg.model_dump(exclude={"slo"}, exclude_unset=True)  # (the fields that tree knows)
    config["decode"]["engine"] = {**config["decode"]["engine"], "long_prefill_token_threshold": 128}
    return config | {"name": "tuned", "remote_prefill_min_tokens": 0, "remote_prefill_max_queued_tokens": 1536,
                     "overflow_prefill_pause_s": 2.0, "overflow_prefill_max_tokens": 256,
                     "remote_prefill_max_queued_tokens_long": 3072}


def _baseline_run(tree: str, config: dict, rate: float, seed: int, num_requests: int, ingress: str,
                  start_ray) -> dict:
    """One draw of `config` served by the pdserve of `tree` (its `platform/` imported as `pdserve`
    through a link first on PYTHONPATH, in a child process with its own Ray), between this
    process's Ray sessions: the machine runs one app at a time."""
    import tempfile

    import ray

    ray.shutdown()
    try:
        with tempfile.TemporaryDirectory() as links:
            os.symlink(os.path.join(os.path.abspath(tree), "platform"), os.path.join(links, "pdserve"))
            spec = json.dumps({"config": config, "rate": rate, "seed": seed, "requests": num_requests,
                               "ingress": ingress})
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([links, os.path.dirname(__file__)])}
            child = subprocess.run([sys.executable, __file__, "--child-run", spec], env=env, capture_output=True,
                                   text=True, timeout=1800)
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode or not lines:
            raise RuntimeError(f"the baseline tree's run failed ({child.returncode}):\n{child.stderr[-3000:]}")
        result = json.loads(lines[-1])
        print(f"baseline tree: pdserve from {result.pop('pdserve_from')}", flush=True)
        return result
    finally:
        start_ray()


def _child_run(spec: dict) -> None:
    """--child-run: one draw of the long-prompt mix against `spec["config"]`, printed as a JSON line."""
    import pdserve
    import ray
    from pdserve.bench.workloads import PromptBuilder, random_workload
    from pdserve.config import ServeConfig

    config = ServeConfig.model_validate(spec["config"])
    builder = PromptBuilder(config.model)
    mix = part2_requests(builder, spec["requests"], spec["seed"], "long-prompt-mix")
    warmup = random_workload(builder, 1, "128", "32", seed=1000)[0]
    _start_ray(config.model, spec["ingress"])
    try:
        result = served_runs(config, {0: mix}, builder, warmup, spec["rate"], MIX_SLO)[0]
    finally:
        ray.shutdown()
    print(json.dumps({**result, "pdserve_from": list(pdserve.__path__)[0]}))


def _print(report: dict) -> None:
    print(f"\nmachine: {report['machine']}; model {report['model']}\n")
    print("| setup | concurrency | median TTFT ms | median ITL ms | p99 ITL ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for setup, by_c in report["hops"].items():
        for c, m in by_c.items():
            print(f"| {setup} | {c} | {m['median_ttft_ms']:.1f} | {m['median_itl_ms']:.2f} | {m['p99_itl_ms']:.2f} "
                  f"| {m['output_throughput']:.1f} |")
    hops = report["hops"]
    for setup, by_c in hops.items():  # each served run over the offline run of its round
        offline = hops.get(setup.replace("colocated", "offline").replace("disaggregated", "offline")
                           .replace("handle", "offline"))
        if offline is None or offline is by_c:
            continue
        for c in by_c:
            ratio = by_c[c]["median_itl_ms"] / offline[c]["median_itl_ms"]
            print(f"{setup} median ITL / offline at concurrency {c}: {ratio:.3f}")
    for load, by_setup in report["interference"].items():
        print(f"\n{load}:\n")
        print("| setup | p50 ITL ms | p99 ITL ms | median TTFT ms | p99 TTFT ms | goodput req/s | within SLO "
              "| completed |")
        print("|---|---|---|---|---|---|---|---|")
        for setup, m in by_setup.items():
            print(f"| {setup} | {m['median_itl_ms']:.2f} | {m['p99_itl_ms']:.2f} | {m['median_ttft_ms']:.1f} "
                  f"| {m['p99_ttft_ms']:.1f} | {m['request_goodput']:.3f} | {m['slo_attainment']:.3f} "
                  f"| {m['completed']}/{m['num_requests']} |")
        c = by_setup["colocated"]
        for setup, m in by_setup.items():
            if setup != "colocated":
                print(f"{setup}: p99 ITL / colocated {m['p99_itl_ms'] / c['p99_itl_ms']:.3f}, "
                      f"goodput / colocated {m['request_goodput'] / c['request_goodput']:.3f}")
    if report["max_goodput"]:
        from pdserve.bench.report import max_goodput_line

        print(f"\nmax goodput over the rates run ({report['attainment']:.0%} of requests within SLO):\n")
        for draw, by_setup in report["max_goodput"].items():
            for setup, g in by_setup.items():
                print(f"{draw}, {setup}: {max_goodput_line(g, report['attainment'])}")
    print(json.dumps(report, default=lambda o: asdict(o) if is_dataclass(o) else str(o)))


if __name__ == "__main__":
    main()
