"""`pdserve bench`: load an OpenAI-compatible server and report serving metrics.

    pdserve bench --base-url http://127.0.0.1:8000 --workload random --num-requests 200 --rate 4
    pdserve bench sweep --rates 1,2,4,8 --out-dir results/sweep
    pdserve bench --compare a.json b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    t.add_argument("--api-key", help="sent as a bearer token")
    t.add_argument("--tokenizer", help="local Hugging Face tokenizer directory: makes prompt token counts exact")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "long-prompt-mix", "replay"], default="random")
    w.add_argument("--num-requests", type=int, default=100)
    w.add_argument("--input-len", default="128", help="N, LOW:HIGH (uniform) or a histogram file (default 128)")
    w.add_argument("--output-len", default="128", help="N, LOW:HIGH or a histogram file (default 128)")
    w.add_argument("--num-tenants", type=int, default=8, help="shared-prefix: tenants")
    w.add_argument("--system-prompt-len", type=int, default=1000, help="shared-prefix: tokens per tenant prompt")
    w.add_argument("--question-len", default="32:96", help="shared-prefix: question tokens")
    w.add_argument("--popularity", choices=["zipf", "uniform"], default="zipf")
    w.add_argument("--long-len", default="2048", help="long-prompt-mix: long prompt tokens")
    w.add_argument("--long-fraction", type=float, default=0.05, help="long-prompt-mix: share of long prompts")
    w.add_argument("--trace", help="replay: JSONL trace file")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the server stop at EOS (default: ask for exactly --output-len tokens)")
    a = p.add_argument_group("arrivals and reporting")
    a.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    a.add_argument("--duration", type=float, help="stop sending new requests after this many seconds")
    a.add_argument("--slo", help="goodput SLO, e.g. ttft=500ms,tpot=50ms")
    a.add_argument("--percentiles", default="50,90,99")
    a.add_argument("--no-progress", dest="progress", action="store_false")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (default: all at once)")
    p.add_argument("--concurrency", type=int, help="keep this many requests in flight instead of a rate")
    p.add_argument("--result-file", help="write the JSON result here")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print B against A and exit")
    p.set_defaults(handler=_run)
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    s = modes.add_parser("sweep", help="run a series of offered loads; write a table and plots",
                         description="Run the workload at each rate (or concurrency) and write sweep.json, "
                                     "sweep_load.png and sweep_latency_cdf.png to --out-dir.")
    _common(s)
    load = s.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", help="comma-separated requests/s, e.g. 1,2,4,8")
    load.add_argument("--concurrencies", help="comma-separated in-flight counts, e.g. 1,8,32")
    s.add_argument("--out-dir", default="bench-sweep")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="with --rates and --slo: report the highest rate at which this share of requests meets the "
                        "SLO (DistServe's goodput; default %(default)s)")
    s.set_defaults(handler=_sweep)


def _settings(args, **over):
    from pdserve.bench.metrics import parse_slo
    from pdserve.bench.runner import RunSettings

    return RunSettings(base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model,
                       arrival=args.arrival, duration_s=args.duration, timeout_s=args.timeout, seed=args.seed,
                       ignore_eos=args.ignore_eos, api_key=args.api_key, slo=parse_slo(args.slo),
                       percentiles=tuple(float(x) for x in args.percentiles.split(",")), **over)


def _workload(args):
    from pdserve.bench import workloads as w

    builder = w.PromptBuilder(args.tokenizer)
    n = args.num_requests
    if args.workload == "random":
        reqs = w.random_workload(builder, n, args.input_len, args.output_len, args.seed)
    elif args.workload == "shared-prefix":
        reqs = w.shared_prefix_workload(builder, n, args.num_tenants, args.system_prompt_len, args.question_len,
                                        args.output_len, args.popularity, seed=args.seed)
    elif args.workload == "long-prompt-mix":
        reqs = w.long_prompt_mix_workload(builder, n, args.input_len, args.long_len, args.output_len,
                                          args.long_fraction, seed=args.seed)
    else:
        if not args.trace:
            raise ValueError("--workload replay needs --trace FILE")
        reqs = w.replay_workload(builder, args.trace, args.seed)
    return builder, reqs


def _run(args) -> int:
    from pdserve.bench import report

    try:
        if args.compare:
            a, b = (report.load(f) for f in args.compare)
            print(report.compare(a, b, Path(args.compare[0]).stem, Path(args.compare[1]).stem))
            return 0
        builder, reqs = _workload(args)
        settings = _settings(args, rate=args.rate, concurrency=args.concurrency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdserve.bench.runner import run_benchmark

    result = run_benchmark(reqs, settings, builder, args.workload, args.progress)
    print(report.table(result))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.result_file}")
    return 0 if result["completed"] else 1


def _sweep(args) -> int:
    from pdserve.bench import report
    from pdserve.bench.metrics import check_attainment
    from pdserve.bench.runner import run_benchmark

    try:
        check_attainment(args.attainment)
        builder, reqs = _workload(args)
        points = [("rate", float(x)) for x in args.rates.split(",")] if args.rates else \
            [("concurrency", int(x)) for x in args.concurrencies.split(",")]
        settings = [_settings(args, **{key: value}) for key, value in points]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_key = points[0][0]
    results = []
    for (key, value), s in zip(points, settings):
        print(f"== {key} {value}", file=sys.stderr)
        results.append(run_benchmark(reqs, s, builder, args.workload, args.progress))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(results, indent=1))
    print(report.sweep_table(results, load_key, args.attainment))
    pngs = report.sweep_plots(results, load_key, out, [(f"{load_key} {r[load_key]}", r["e2els_ms"]) for r in results],
                              args.attainment)
    print("wrote " + ", ".join(str(p) for p in [out / "sweep.json", *pngs]))
    return 0
