"""`pdserve simulate`: run a deployment in simulation and report what it would serve.

    pdserve simulate --model llama-3.1-8b --accelerator H100 --prefill-replicas 4 --decode-replicas 8 \\
        --workload long-prompt-mix --rate 50 --duration 120 --ttft-ms 1000 --itl-ms 50
    pdserve simulate --model serve-llama-40m --accelerator cpu --workload replay --trace trace.jsonl --json
    pdserve simulate --autoscale --max-total-replicas 64 --rate-steps 0:200,120:800,240:200 --duration 360 ...
    pdserve simulate calibrate          # fit the cpu profile to this machine's engine

The workload flags are `pdserve bench`'s (same generators, same seeds: `--num-requests N --rate R`
replays the requests and arrival times `pdserve bench` sends with the same flags); `--duration`
without `--num-requests` streams Poisson arrivals for that long.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a deployment (discrete events on pdserve's own routing, "
                                        "placement and autoscaling)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("deployment")
    d.add_argument("--config", help="a pdserve config: the pools (replicas, TP, accelerator_type), the decode engine's "
                                    "limits and slo come from it, and the flags for those are ignored; where it "
                                    "autoscales both pools against its slo, so does the simulation, with its "
                                    "max_total_replicas, each pool's min/max_replicas and downscale delay")
    d.add_argument("--model", help="a checkpoint directory, an engine preset or a public config name (default: the "
                                   "config's model, else serve-llama-40m)")
    d.add_argument("--accelerator", default="cpu", help="both pools' accelerator: H100, H200, A100, MI300X or cpu")
    d.add_argument("--prefill-accelerator", help="the prefill pool's, when it differs")
    d.add_argument("--decode-accelerator", help="the decode pool's, when it differs")
    d.add_argument("--prefill-replicas", type=int, default=1, help="0: colocated (decode replicas prefill)")
    d.add_argument("--decode-replicas", type=int, default=1)
    d.add_argument("--prefill-tp", type=int, default=1)
    d.add_argument("--decode-tp", type=int, default=1)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-num-batched-tokens", type=int, default=2048, help="a step's token budget")
    d.add_argument("--max-num-seqs", type=int, default=64, help="most sequences a decode replica holds")
    d.add_argument("--max-ongoing-requests", type=int,
                   help="most requests a decode replica takes at once (default: max-num-seqs, at least 64)")
    d.add_argument("--no-split-prompts-to-fill-steps", dest="split_prompts_to_fill_steps", action="store_false",
                   help="the engine option off (as on CPU pools): a prompt that would not finish in a step starts "
                        "only in one that prefills nothing else")
    d.add_argument("--cpu-calibration", help="the cpu profile's calibration file (default: the one shipped)")
    d.add_argument("--this-machine", action="store_true",
                   help="cpu pools only: every replica on this one machine, as the real app runs here: they and "
                        "the request path share its cores, and each request's path (HTTP, gateway, Ray calls) costs "
                        "the latency and CPU time measured here (cpu_host.json, benchmarks/simulator_host.py)")
    slo_args(p)
    a = p.add_argument_group("autoscaling (the joint P:D policy)")
    a.add_argument("--autoscale", action="store_true")
    a.add_argument("--max-total-replicas", type=int, help="the replica budget shared by both pools (given with "
                                                          "--config: in place of its max_total_replicas; each "
                                                          "pool's own bounds still apply)")
    a.add_argument("--tick-s", type=float, default=5.0, help="control period and look-back window")
    a.add_argument("--downscale-delay-s", type=float, default=30.0,
                   help="how long a pool's want stays low before it shrinks (default %(default)s)")
    a.add_argument("--replica-start-s", type=float, default=30.0, help="a new replica's start-up time")
    workload_args(p).add_argument(
        "--warmup", metavar="PROMPT:OUTPUT", type=_warmup,
        help="first serve one request of these lengths alone, as benchmarks/serving.py warms its app up (the "
             "replicas' cost models start from what it measured); the result leaves it out")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object")
    o.add_argument("--result-file", help="also write the JSON result here")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(handler=_simulate, prefill_bounds=None, decode_bounds=None)  # (--config sets them)
    modes = p.add_subparsers(dest="simulate_mode", metavar="MODE")
    c = modes.add_parser("calibrate", help="fit the cpu profile to this machine's engine",
                         description="Time the real engine's decode steps and prefills and fit the cpu profile's "
                                     "effective bandwidth, FLOP/s and step overhead (pdserve.simulate.calibration).")
    c.add_argument("--model", default="serve-llama-40m", help="an engine preset or checkpoint (default %(default)s)")
    c.add_argument("--threads", type=int, default=1, help="engine threads (default 1: a one-core replica)")
    c.add_argument("--out", help="where to write it (default: the calibration file the simulator reads)")
    c.add_argument("--no-progress", dest="progress", action="store_false")
    c.set_defaults(handler=_calibrate)
    from pdserve.simulate import plan_cli

    plan_cli.register(sub)


def slo_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("latency target")
    s.add_argument("--ttft-ms", type=float, default=4000.0)
    s.add_argument("--itl-ms", type=float, default=150.0)
    s.add_argument("--percentile", type=float, default=99.0, help="share of requests that must meet it (percent)")


def workload_args(p: argparse.ArgumentParser):
    """The workload flags' group (returned: a command adds its own)."""
    w = p.add_argument_group("workload (as pdserve bench)")
    w.add_argument("--workload", choices=["random", "shared-prefix", "long-prompt-mix", "replay"], default="random")
    w.add_argument("--num-requests", type=int, help="this many requests at --rate (the bench's own draw)")
    w.add_argument("--rate", type=float, help="requests/s")
    w.add_argument("--rate-steps", help="a rate that changes: SECONDS:RATE,... e.g. 0:100,60:400,120:100")
    w.add_argument("--duration", type=float, help="stream Poisson arrivals for this many seconds")
    w.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    w.add_argument("--input-len", default="128")
    w.add_argument("--output-len", default="128")
    w.add_argument("--num-tenants", type=int, default=8)
    w.add_argument("--system-prompt-len", type=int, default=1000)
    w.add_argument("--question-len", default="32:96")
    w.add_argument("--popularity", choices=["zipf", "uniform"], default="zipf")
    w.add_argument("--long-len", default="2048")
    w.add_argument("--long-fraction", type=float, default=0.05)
    w.add_argument("--long-output-len", default="16")
    w.add_argument("--trace", help="replay: a JSONL trace (arrival_s, prompt_tokens, output_tokens, "
                                   "optional prefix_id and prefix_tokens)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--arrival-seed", type=int, help="the arrivals' seed, when not --seed's (benchmarks/serving.py "
                                                    "draws its mix with one seed and its arrivals with 0)")
    w.add_argument("--tokenizer", help="the bench's --tokenizer: the same draw as a bench run that built its "
                                       "prompts with it")
    return w


def _warmup(text: str):
    from pdserve.simulate.workload import SimRequest

    try:
        prompt, output = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give PROMPT_TOKENS:OUTPUT_TOKENS, e.g. 128:32") from None
    if prompt < 1 or output < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both lengths must be at least 1")
    return SimRequest(0.0, prompt, output)


def build(args):
    """(SimConfig, requests, simulated seconds expected) from the parsed flags."""
    from pdserve.autoscale.joint import Slo
    from pdserve.simulate.hardware import accelerator, load_host
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import AutoscaleSpec, PoolSpec, SimConfig

    if args.config:
        _from_config(args)
    args.model = args.model or "serve-llama-40m"
    calibration = Path(args.cpu_calibration) if args.cpu_calibration else None
    prefill_acc = accelerator(args.prefill_accelerator or args.accelerator, calibration)
    decode_acc = accelerator(args.decode_accelerator or args.accelerator, calibration)
    on_gpu = "cpu" not in (prefill_acc.name, decode_acc.name)
    host = None
    if args.this_machine:
        if {prefill_acc.name, decode_acc.name} != {"cpu"}:
            raise ValueError("--this-machine describes this machine: it needs --accelerator cpu for both pools")
        host = load_host()
    model = load_model(args.model, 2 if on_gpu else None, 2 if on_gpu else None)  # bf16 on GPUs
    autoscale = None
    if args.autoscale:
        if not args.max_total_replicas:
            raise ValueError("--autoscale needs --max-total-replicas")
        if args.prefill_replicas == 0:
            raise ValueError("--autoscale sizes both pools: it needs --prefill-replicas >= 1")
        autoscale = AutoscaleSpec(args.max_total_replicas, args.tick_s, args.downscale_delay_s, args.replica_start_s,
                                  prefill_bounds=args.prefill_bounds, decode_bounds=args.decode_bounds)
    config = SimConfig(model=model, decode=PoolSpec(decode_acc, args.decode_replicas, args.decode_tp),
                       prefill=PoolSpec(prefill_acc, args.prefill_replicas, args.prefill_tp)
                       if args.prefill_replicas else None,
                       slo=Slo(args.ttft_ms / 1000, args.itl_ms / 1000, args.percentile), block_size=args.block_size,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       max_ongoing_requests=args.max_ongoing_requests,
                       split_prompts_to_fill_steps=args.split_prompts_to_fill_steps, seed=args.seed,
                       autoscale=autoscale, host=host)
    requests, expected_s = workload_requests(args)
    return config, requests, expected_s


def _from_config(args) -> None:
    """Set the deployment flags from `--config` (accelerators only where its accelerator_type
    names a profile; the model only where --model is not given)."""
    from pdserve.simulate.from_config import read

    dep = read(args.config)
    args.model = args.model or dep.model
    args.prefill_replicas, args.decode_replicas = dep.prefill_replicas, dep.decode_replicas
    args.prefill_tp, args.decode_tp = dep.prefill_tp, dep.decode_tp
    args.prefill_accelerator = dep.prefill_accelerator or args.prefill_accelerator
    args.decode_accelerator = dep.decode_accelerator or args.decode_accelerator
    args.block_size, args.max_num_batched_tokens = dep.block_size, dep.max_num_batched_tokens
    args.max_num_seqs, args.max_ongoing_requests = dep.max_num_seqs, dep.max_ongoing_requests
    args.split_prompts_to_fill_steps = dep.split_prompts_to_fill_steps
    if dep.slo is not None:
        args.ttft_ms, args.itl_ms, args.percentile = dep.slo
    if dep.max_total_replicas is not None:  # one policy sizes both pools against the slo
        args.autoscale = True
        args.max_total_replicas = args.max_total_replicas or dep.max_total_replicas
        args.prefill_bounds, args.decode_bounds = dep.prefill_bounds, dep.decode_bounds
        args.downscale_delay_s = dep.downscale_delay_s


def workload_requests(args):
    """(requests, simulated seconds expected) from the workload flags."""
    from pdserve.simulate import workload as w

    if args.workload == "replay":
        if not args.trace:
            raise ValueError("--workload replay needs --trace FILE")
        reqs = list(w.trace_requests(args.trace))
        return iter(reqs), reqs[-1].arrival_s if reqs else 0.0
    spec = w.WorkloadSpec(args.workload, args.input_len, args.output_len, args.num_tenants, args.system_prompt_len,
                          args.question_len, args.popularity, args.long_len, args.long_fraction, args.long_output_len)
    steps = w.parse_rate_steps(args.rate_steps) if args.rate_steps else None
    pool_size = w.tokenizer_pool_size(args.tokenizer) if args.tokenizer else 24
    if args.num_requests is not None:
        expected = args.num_requests / args.rate if args.rate else 0.0
        return w.bench_requests(spec, args.seed, num_requests=args.num_requests, rate=args.rate,
                                arrival=args.arrival, pool_size=pool_size, arrival_seed=args.arrival_seed), expected
    if not args.duration or not (args.rate or steps):
        raise ValueError("give --num-requests (and --rate), or --duration with --rate or --rate-steps")
    return w.bench_requests(spec, args.seed, rate=args.rate, duration_s=args.duration, rate_steps=steps,
                            pool_size=pool_size), args.duration


def _simulate(args) -> int:
    from tqdm import tqdm

    from pdserve.simulate.report import table
    from pdserve.simulate.sim import Simulation

    try:
        config, requests, expected_s = build(args)
        sim = Simulation(config)
    except ValueError as e:
        print(f"pdserve simulate: {e}", file=sys.stderr)
        return 2
    bar = tqdm(total=round(expected_s, 1) or None, desc="simulating", unit="sim s", disable=not args.progress,
               file=sys.stderr)

    def progress(t: float) -> None:
        bar.update(round(t, 1) - bar.n)

    try:
        result = sim.run(requests, progress, [args.warmup] if args.warmup else [])
    finally:
        bar.close()
    result["config"] = describe(config)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else table(result))
    return 0


def describe(config) -> dict:
    pools = {"decode": config.decode, **({"prefill": config.prefill} if config.prefill else {})}
    return {"model": config.model.name, "mode": "disaggregated" if config.prefill else "colocated",
            **{f"{name}_pool": {"accelerator": p.accelerator.name, "replicas": p.num_replicas, "tp": p.tp}
               for name, p in pools.items()},
            "max_total_replicas": config.autoscale.max_total_replicas if config.autoscale else None}


def _calibrate(args) -> int:
    from pdserve.simulate.calibration import calibrate
    from pdserve.simulate.hardware import CPU_CALIBRATION

    out = Path(args.out) if args.out else CPU_CALIBRATION
    result = calibrate(args.model, out, args.threads, args.progress)
    prof = result["profile"]
    print(f"{result['machine']}\ncpu profile: weights streamed at {prof['hbm_bytes_per_s'] / 1e9:.2f} GB/s, "
          f"{prof['flops_per_s'] / 1e9:.1f} GFLOP/s, KV read at {prof['attention_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"fit error "
          f"median {result['fit']['median_abs_rel_error']:.1%}, max {result['fit']['max_abs_rel_error']:.1%}\n"
          f"wrote {out}")
    return 0
