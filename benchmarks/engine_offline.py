"""Offline engine benchmark: batch-1 decode against the memory-bandwidth roofline, and batched
throughput against transformers `generate` with static batches — all in one run.

    python benchmarks/engine_offline.py            # full run (a few minutes on 2 cores)
    python benchmarks/engine_offline.py --quick    # smaller counts, for a smoke check

Model: the `bench-llama-56m` preset (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408,
vocab 32000; fp32), generated into the pdserve cache on first use. Each measurement runs in its
own child process so peak resident memory is per phase. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

from cpu_linear import median_seconds  # this folder's scripts run with it on sys.path
from machine import machine_line, warn_if_pinned

PRESET = "bench-llama-56m"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def decode_weight_bytes(model) -> int:
    """Weight bytes a batch-1 decode step reads: `num_decode_weight_bytes`, less, in each mixture of
    experts, the experts a token does not choose (it reads `top_k` of `num_experts`)."""
    total = model.num_decode_weight_bytes()
    for m in model.modules():
        if hasattr(m, "w13") and hasattr(m, "top_k"):
            experts = (m.w13.numel() + m.w2.numel()) * m.w13.element_size()
            total -= experts * (m.num_experts - m.top_k) // m.num_experts
    return total


# -- phases (each runs in a child process) -------------------------------------------------------

def _gemv_forms(k: int, nbytes: int) -> dict[str, callable]:
    """One fp32 GEMV over `nbytes` of weights with inner dimension k, in each formulation this
    machine has: `x @ W^T`, `x @ W`, oneDNN's packed matmul, pdserve's packed matmul."""
    from pdserve.engine.kernels import cpu_kernels

    w = torch.randn(nbytes // 4 // k, k)
    x = torch.randn(1, k)
    forms = {"x@W^T": lambda: torch.nn.functional.linear(x, w)}
    wt = w.t().contiguous()
    forms["x@W"] = lambda: torch.mm(x, wt)
    if torch.backends.mkldnn.is_available():
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        forms["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    if cpu_kernels.usable(w):
        panels = cpu_kernels.pack_linear(w)
        forms["pdserve"] = lambda: cpu_kernels.linear(x, panels, w.shape[0], None)
    return forms


def _gemv_rate(f, nbytes: int, repeats: int) -> float:
    """Bytes per second of f() (a GEMV over nbytes), median over `repeats` calls after warm-up."""
    return nbytes / median_seconds(f, repeats)


def phase_roofline(args) -> dict:
    """One large fp32 GEMV over as many bytes as a decode step reads, as fast as this machine does
    it: the best over three inner dimensions and every formulation of `_gemv_forms`. A conservative
    ceiling: the decode step runs many smaller GEMVs."""
    from pdserve.engine.models.loader import load_model

    model, _ = load_model(args.model)
    nbytes = decode_weight_bytes(model)
    del model
    rates = {}
    for k in (512, 1408, 4096):
        for form, f in _gemv_forms(k, nbytes).items():
            rates[f"{form}, K={k}"] = _gemv_rate(f, nbytes, args.repeats * 5) / 1e9
    best_form = max(rates, key=rates.get)
    return {"gemv_bytes": nbytes, "gemv_gb_s": rates[best_form], "gemv_form": best_form,
            "gemv_gb_s_by_form": {f: round(r, 2) for f, r in rates.items()}, "peak_rss_mib": _peak_rss_mib()}


def phase_ours_decode(args) -> dict:
    """Batch-1 decode; with --roofline-form, that GEMV is also timed between the decode steps, so
    each repeat has its own roofline from the same seconds (this machine's memory bandwidth drifts
    by tens of percent within minutes, so a roofline measured in another phase, or even right
    after the repeat, is a poor yardstick). Every 16 steps it runs three times back to back and
    the fastest counts; a repeat's roofline is the median of those. Only the steps are timed for
    the decode rate."""
    from pdserve.engine.kernels import cpu_decoder
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(args.model, num_kv_blocks=256)
    engine = llm.engine
    nbytes = decode_weight_bytes(engine.model)
    is_c_step = cpu_decoder.decoder_for(engine.model, engine.kv_cache) is not None
    gemv = None
    if args.roofline_form:
        form, k = args.roofline_form.split(", K=")
        gemv = _gemv_forms(int(k), nbytes).get(form)
    rates, ratios = [], []
    for i in range(args.repeats + 1):  # the first run warms up
        engine.add_request(f"d{i}", list(range(100, 116)), SamplingParams(max_tokens=args.decode_tokens + 1,
                                                                          temperature=0, ignore_eos=True))
        engine.step()  # prefill + first token
        n, decode_s, gemv_s = 0, 0.0, []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            n += len(engine.step())
            decode_s += time.perf_counter() - t
            if gemv is not None and n % 16 == 0:
                gemv_s.append(min(_seconds(gemv) for _ in range(3)))
        if i:
            rates.append(n / decode_s)
            if gemv_s:
                ratios.append(statistics.median(gemv_s) * rates[-1])  # roofline step time / our step time
    tok_s = statistics.median(rates)
    return {"decode_tok_s": tok_s, "step_ms": 1e3 / tok_s, "weight_bytes": nbytes,
            "implied_gb_s": nbytes * tok_s / 1e9, "paired_roofline_ratios": ratios,
            "paired_roofline_ratio": statistics.median(ratios) if ratios else None, "c_decode_step": is_c_step,
            "peak_rss_mib": _peak_rss_mib()}


def _seconds(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def phase_hf_decode(args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.arange(100, 116)[None]
    rates = []
    for i in range(args.repeats + 1):
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_tokens + 1,
                                 min_new_tokens=args.decode_tokens + 1, do_sample=False)
            t2 = time.perf_counter()
        if i:
            # Subtract one prefill (+ first token) so both sides time decode steps only.
            rates.append((out.shape[1] - ids.shape[1] - 1) / ((t2 - t1) - (t1 - t)))
    return {"decode_tok_s": statistics.median(rates), "peak_rss_mib": _peak_rss_mib()}


def _workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 32000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    outputs = [rng.randint(args.min_out, args.max_out) for _ in range(args.num_requests)]
    return prompts, outputs


def phase_ours_throughput(args) -> dict:
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    prompts, outputs = _workload(args)
    llm = LLM(args.model, max_num_seqs=args.num_requests)
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    num_out = sum(len(o.token_ids) for o in outs)
    assert num_out == sum(outputs)
    return {"output_tokens": num_out, "elapsed_s": elapsed, "output_tok_s": num_out / elapsed,
            "peak_rss_mib": _peak_rss_mib()}


def phase_hf_throughput(args) -> dict:
    from transformers import AutoModelForCausalLM

    prompts, outputs = _workload(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:32]]), max_new_tokens=8, do_sample=False)  # warm-up
        t = time.perf_counter()
        useful = 0
        for s in range(0, len(prompts), args.hf_batch):
            batch = torch.tensor(prompts[s:s + args.hf_batch])  # equal lengths: no padding needed
            want = outputs[s:s + args.hf_batch]
            # A static batch runs until its longest request is done; only each request's own
            # tokens count as useful output.
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max(want),
                                 min_new_tokens=max(want), do_sample=False)
            assert out.shape[1] - batch.shape[1] == max(want)
            useful += sum(want)
        elapsed = time.perf_counter() - t
    return {"batch_size": args.hf_batch, "output_tokens": useful, "elapsed_s": elapsed,
            "output_tok_s": useful / elapsed, "peak_rss_mib": _peak_rss_mib()}


PHASES = {f.__name__.removeprefix("phase_"): f for f in (
    phase_roofline, phase_ours_decode, phase_hf_decode, phase_ours_throughput, phase_hf_throughput)}


# -- driver ---------------------------------------------------------------------------------------

def _run_child(phase: str, argv: list[str], extra: list[str] = (), env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, *argv, *extra],
                         capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"phase {phase} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine_line() -> str:
    return (f"{machine_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{time.strftime('%Y-%m-%d')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller counts for a smoke run")
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help="checkpoint directory (default: the bench-llama-56m preset)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--roofline-form", help=argparse.SUPPRESS)
    ap.add_argument("--hf-batches", default="64,16", help="static batch sizes tried for transformers")
    args = ap.parse_args()
    warn_if_pinned()

    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return
    if args.quick:
        args.repeats, args.decode_tokens, args.num_requests, args.max_out = 1, 32, 16, 64
    if not args.model:
        from pdserve.engine.checkpoint import default_model
        args.model = str(default_model(PRESET))
    argv = ["--model", args.model, "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens),
            "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
            "--min-out", str(args.min_out), "--max-out", str(args.max_out)]

    roof = _run_child("roofline", argv)
    ours_dec = _run_child("ours_decode", argv, ["--roofline-form", roof["gemv_form"]])
    # The same engine without its C kernels (oneDNN matmuls, torch attention, layer by layer).
    torch_path = {"PDSERVE_CPU_KERNELS": "torch"}
    ours_dec_torch = _run_child("ours_decode", argv, env=torch_path)
    hf_dec = _run_child("hf_decode", argv)
    ours_tp = _run_child("ours_throughput", argv)
    ours_tp_torch = _run_child("ours_throughput", argv, env=torch_path)
    hf_tps = [_run_child("hf_throughput", argv, ["--hf-batch", b]) for b in args.hf_batches.split(",")]
    best_hf = max(hf_tps, key=lambda r: r["output_tok_s"])

    roof_tok_s = roof["gemv_gb_s"] * 1e9 / ours_dec["weight_bytes"]
    rows = [
        ("GEMV roofline over the decode step's weight bytes",
         f"{roof['gemv_gb_s']:.2f} GB/s ({roof['gemv_form']}) = {roof_tok_s:.1f} tok/s ceiling "
         f"({roof['gemv_bytes'] / 1e6:.0f} MB/step)"),
        ("pdserve batch-1 decode", f"{ours_dec['decode_tok_s']:.1f} tok/s, {ours_dec['implied_gb_s']:.2f} GB/s "
                                   f"= {ours_dec['implied_gb_s'] / roof['gemv_gb_s']:.0%} of roofline"),
        ("pdserve batch-1 decode against the roofline GEMV timed between its steps (median of repeats)",
         "no pairing" if ours_dec["paired_roofline_ratio"] is None else
         f"{ours_dec['paired_roofline_ratio']:.0%} (repeats: "
         f"{', '.join(f'{r:.0%}' for r in ours_dec['paired_roofline_ratios'])})"),
        ("pdserve batch-1 decode without its C kernels (`PDSERVE_CPU_KERNELS=torch`)",
         f"{ours_dec_torch['decode_tok_s']:.1f} tok/s = {ours_dec_torch['implied_gb_s'] / roof['gemv_gb_s']:.0%} "
         f"of roofline"),
        ("transformers batch-1 decode", f"{hf_dec['decode_tok_s']:.1f} tok/s = "
                                        f"{hf_dec['decode_tok_s'] / roof_tok_s:.0%} of roofline"),
        (f"pdserve {args.num_requests} requests (continuous batching)",
         f"{ours_tp['output_tok_s']:.0f} output tok/s in {ours_tp['elapsed_s']:.1f} s, "
         f"peak RSS {ours_tp['peak_rss_mib']:.0f} MiB"),
        ("pdserve, same requests, without its C kernels (`PDSERVE_CPU_KERNELS=torch`)",
         f"{ours_tp_torch['output_tok_s']:.0f} output tok/s in {ours_tp_torch['elapsed_s']:.1f} s"),
    ]
    for r in hf_tps:
        rows.append((f"transformers static batches of {r['batch_size']}",
                     f"{r['output_tok_s']:.0f} useful output tok/s in {r['elapsed_s']:.1f} s, "
                     f"peak RSS {r['peak_rss_mib']:.0f} MiB"))
    rows.append(("throughput ratio (pdserve / best transformers)",
                 f"{ours_tp['output_tok_s'] / best_hf['output_tok_s']:.2f}x"))
    print(f"machine: {_machine_line()}")
    print(f"command: python benchmarks/engine_offline.py{' --quick' if args.quick else ''}\n")
    print("| measurement | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(json.dumps({"bench": "engine_offline", "quick": args.quick, "roofline": roof, "ours_decode": ours_dec,
                      "ours_decode_torch_path": ours_dec_torch, "hf_decode": hf_dec, "ours_throughput": ours_tp, "ours_throughput_torch_path": ours_tp_torch,
                      "hf_throughput": hf_tps}))


if __name__ == "__main__":
    main()
