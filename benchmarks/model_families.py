"""Each model family beside Llama at the same ~56M-parameter shape (#44): batch-1 decode against the
weight-streaming roofline timed between its own steps, and 64-request throughput against
transformers, all in one run so that the families' ratios can be compared with Llama's.

    python benchmarks/model_families.py                       # every family, a few minutes each on 2 cores
    python benchmarks/model_families.py --families llama,qwen3 --repeats 3

Models: the `bench-<family>-56m` presets (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate
1408, vocabulary 32,000, fp32; each family's own parts: Qwen3's q/k norms, Qwen3-MoE's experts,
Phi-3's fused projections and LongRoPE, Gemma 3's sliding windows, DeepSeek-V3's latent attention
and DeepSeekMoE), generated into the pdserve cache on first use. The measurements are engine_offline.py's phases, each in a child process:
the fastest GEMV form on this machine is chosen once (over Llama's bytes), then timed between each
family's decode steps over that family's bytes (a mixture of experts: the experts a token
chooses); for each family pdserve's 64 requests and transformers' static batches of 64 run back to
back. The last columns are each family's ratios over Llama's. Prints a markdown table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from engine_offline import _machine_line, _run_child  # this folder's scripts run with it on sys.path
from machine import warn_if_pinned

FAMILIES = {"llama": "bench-llama-56m", "qwen3": "bench-qwen3-56m", "qwen3-moe": "bench-qwen3-moe-56m",
            "phi3": "bench-phi3-56m", "gemma3": "bench-gemma3-56m", "deepseek-v3": "bench-deepseek-v3-56m"}


def _params_millions(model_dir: str) -> float:
    """Parameters in the checkpoint's tensors (a tied LM head once), millions."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated; llama is always run first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-out", type=int, default=256)
    args = ap.parse_args()
    warn_if_pinned()
    from pdserve.engine.checkpoint import default_model

    families = ["llama", *[f for f in args.families.split(",") if f != "llama"]]
    models = {f: str(default_model(FAMILIES[f])) for f in families}

    def argv(family: str) -> list[str]:
        return ["--model", models[family], "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens),
                "--num-requests", str(args.num_requests), "--max-out", str(args.max_out)]

    roof = _run_child("roofline", argv("llama"))
    decode = {f: _run_child("ours_decode", argv(f), ["--roofline-form", roof["gemv_form"]]) for f in families}
    throughput = {}
    for f in families:  # each family's pair back to back
        ours = _run_child("ours_throughput", argv(f))
        hf = _run_child("hf_throughput", argv(f), ["--hf-batch", str(args.num_requests)])
        throughput[f] = (ours, hf)

    rows = []
    for f in families:
        d, (ours, hf) = decode[f], throughput[f]
        rows.append({"family": f, "preset": FAMILIES[f], "params_m": _params_millions(models[f]),
                     "decode_weight_mb": d["weight_bytes"] / 1e6, "c_decode_step": d["c_decode_step"],
                     "decode_tok_s": d["decode_tok_s"], "roofline_ratio": d["paired_roofline_ratio"],
                     "ours_tok_s": ours["output_tok_s"], "hf_tok_s": hf["output_tok_s"],
                     "throughput_ratio": ours["output_tok_s"] / hf["output_tok_s"]})
    llama = rows[0]
    for r in rows:
        r["roofline_vs_llama"] = r["roofline_ratio"] / llama["roofline_ratio"]
        r["throughput_vs_llama"] = r["throughput_ratio"] / llama["throughput_ratio"]

    print(f"machine: {_machine_line()}")
    print(f"command: python benchmarks/model_families.py --families {','.join(families)} --repeats {args.repeats}")
    print(f"roofline GEMV form: {roof['gemv_form']} ({roof['gemv_gb_s']:.2f} GB/s in its own phase)\n")
    print("| family (preset) | params | bytes a decode step reads | C decode step | batch-1 decode | against the "
          "roofline timed between its steps | 64 requests | transformers, static batches of 64 | throughput "
          "ratio | roofline ratio / Llama's | throughput ratio / Llama's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} ({r['preset']}) | {r['params_m']:.1f}M | {r['decode_weight_mb']:.0f} MB | "
              f"{'yes' if r['c_decode_step'] else 'no'} | {r['decode_tok_s']:.1f} tok/s | {r['roofline_ratio']:.2f} | "
              f"{r['ours_tok_s']:.0f} tok/s | {r['hf_tok_s']:.0f} tok/s | {r['throughput_ratio']:.2f}x | "
              f"{r['roofline_vs_llama']:.2f} | {r['throughput_vs_llama']:.2f} |")
    print(json.dumps({"bench": "model_families", "roofline": roof, "rows": rows, "decode": decode,
                      "throughput": {f: {"ours": o, "hf": h} for f, (o, h) in throughput.items()}}))


if __name__ == "__main__":
    main()
