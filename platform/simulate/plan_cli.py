"""`pdserve plan`: search pool sizes and TP degrees by simulation; print the recommended config.

    pdserve plan --model llama-3.1-8b --accelerators H100,A100 --tp 1,2 --max-gpus 12 \\
        --workload long-prompt-mix --rate 40 --duration 120 --ttft-ms 1000 --itl-ms 50 --out-dir plan/

Each split runs the same Poisson stream (--duration, default 120 simulated seconds: long against a
request's life, so the pools fill as they would). Prints the frontier (per GPU count, the best
split found) and the recommended pdserve config;
with --out-dir also writes plan.json (every candidate), config.yaml (for `pdserve serve`),
values.yaml (the Helm chart's `config` value) and frontier.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from pdserve.simulate.cli import slo_args, workload_args

    p = sub.add_parser("plan", help="find the smallest deployment that meets the SLO, by simulation",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("search space")
    d.add_argument("--model", default="serve-llama-40m",
                   help="a checkpoint directory, an engine preset or a public config name (default %(default)s)")
    d.add_argument("--accelerators", default="cpu", help="accelerator types either pool may use, comma-separated")
    d.add_argument("--tp", default="1", help="tensor-parallel degrees to try, comma-separated (default 1)")
    d.add_argument("--max-gpus", type=int, default=8, help="the budget: devices over both pools")
    d.add_argument("--no-colocated", dest="colocated", action="store_false", help="only disaggregated splits")
    d.add_argument("--max-num-batched-tokens", type=int, default=2048)
    d.add_argument("--max-num-seqs", type=int, default=64)
    d.add_argument("--cpu-calibration", help="the cpu profile's calibration file (default: the one shipped)")
    slo_args(p)
    workload_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", help="write plan.json, config.yaml, values.yaml and frontier.png here")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(handler=_plan)


def _plan(args) -> int:
    import yaml
    from tqdm import tqdm

    from pdserve.autoscale.joint import Slo
    from pdserve.simulate import plan
    from pdserve.simulate.cli import workload_requests
    from pdserve.simulate.hardware import accelerator
    from pdserve.simulate.model import load_model
    from pdserve.simulate.sim import PoolSpec, SimConfig

    try:
        calibration = Path(args.cpu_calibration) if args.cpu_calibration else None
        accs = [accelerator(name.strip(), calibration) for name in args.accelerators.split(",")]
        on_gpu = all(a.name != "cpu" for a in accs)
        model = load_model(args.model, 2 if on_gpu else None, 2 if on_gpu else None)
        if args.num_requests is None and args.duration is None:
            args.duration = 120.0  # long against a request's life, so the decode pool fills as it would
        requests, _ = workload_requests(args)
        requests = list(requests)
        base = SimConfig(model=model, decode=PoolSpec(accs[0], 1), prefill=None,
                         slo=Slo(args.ttft_ms / 1000, args.itl_ms / 1000, args.percentile),
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         seed=args.seed)
        pool = plan.candidates(base, accs, [int(t) for t in args.tp.split(",")], args.max_gpus, args.colocated)
    except ValueError as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if not pool:
        print("pdserve plan: no split fits the budget (is the model too large for one device at these TP "
              "degrees?)", file=sys.stderr)
        return 1
    bar = tqdm(total=len(pool), desc="planning", unit="split", disable=not args.progress, file=sys.stderr)
    try:
        rows, best = plan.search(base, pool, requests, lambda: bar.update(1))
    finally:
        bar.close()
    config = plan.pdserve_config(best["_candidate"], args.model, base.slo) if best else None
    public = [{k: v for k, v in r.items() if k != "_candidate"} for r in rows]
    front = [{k: v for k, v in r.items() if k != "_candidate"} for r in plan.frontier(rows, base.slo)]
    result = {"model": model.name, "num_requests": len(requests), "candidates": public, "frontier": front,
              "recommended": None if best is None else {k: v for k, v in best.items() if k != "_candidate"},
              "config": config}
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
        if config:
            (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            (out / "values.yaml").write_text(yaml.safe_dump({"config": config}, sort_keys=False))
        result["plot"] = plan.plot(rows, base.slo, str(out / "frontier.png"))
    if args.json:
        print(json.dumps(result))
        return 0 if best else 1
    print(f"{len(rows)} splits simulated on {len(requests)} requests; SLO TTFT <= {args.ttft_ms:g} ms, "
          f"ITL <= {args.itl_ms:g} ms for {args.percentile:g}% of requests\n")
    pct = f"p{args.percentile:g}"
    print(f"| GPUs | best split | meets | SLO attainment | goodput req/s | per GPU | {pct} TTFT ms | {pct} ITL ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in front:
        print(f"| {r['num_gpus']} | {r['candidate']} | {'yes' if plan.meets(r, base.slo) else 'no'} | "
              f"{r['slo_attainment']:.3f} | {r['goodput_rps']:.2f} | {r['goodput_per_gpu']:.2f} | "
              f"{r['ttft_ms'][pct]:.0f} | {r['itl_ms'][pct]:.1f} |")
    if best is None:
        print("\nno split within the budget meets the SLO: raise --max-gpus, allow more TP, or relax the target")
        return 1
    print(f"\nrecommended: {best['candidate']} ({best['num_gpus']} GPUs), attainment {best['slo_attainment']:.3f}, "
          f"{best['goodput_per_gpu']:.2f} req/s per GPU\n")
    print(yaml.safe_dump(config, sort_keys=False), end="")
    if args.out_dir:
        print(f"\nwrote {args.out_dir}/plan.json, config.yaml, values.yaml"
              + (", frontier.png" if result.get("plot") else ""))
    return 0
