"""What structured output costs decode throughput (#45): the same prompts decoded unconstrained and
under a JSON schema, at batch 1 and 64, on the offline engine, in one run.

    python benchmarks/structured_decode.py [--batches 1,64] [--tokens 64] [--rounds 3]
    python benchmarks/structured_decode.py --pairs 6 --tokens 32 --batches 64   # on a loaded machine

Model: the `bench-llama-56m` preset (random weights, 32,000-token vocabulary) with the byte-level
BPE of 32,000 tokens that `grammar_mask.py` trains in place of its 1,024-token tokenizer, so the
grammar masks a realistic vocabulary. Every request samples at temperature 1 under its own seed,
from an 8-token prompt (prefill is a small share), for exactly `--tokens` tokens: unconstrained
with `ignore_eos`; constrained by a schema (an array of at least 64 strings of 4-8 characters)
that cannot end sooner, so both runs produce the same number of tokens, most of them inside JSON
strings (the grammar's costliest masks). A third setup fills the masks after the forward pass
instead of during it (what overlapping them buys). Rounds alternate the setups; the figure is
each one's median output tokens/s and the ratio of the medians to unconstrained. Prints a
markdown table and one JSON line. With `--pairs N`, instead: N short unconstrained and constrained
runs back to back (their order alternating), each pair's ratio and the median of those (on a
shared machine, load changes less within a pair than across rounds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from grammar_mask import tokenizer_json  # this folder's scripts run with it on sys.path
from machine import machine_line
from pdserve.engine.checkpoint import default_model
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 8}, "minItems": 64}


def checkpoint(out: Path) -> Path:
    """bench-llama-56m with the 32k-token tokenizer (its special tokens have the same ids)."""
    shutil.copytree(default_model("bench-llama-56m"), out)
    (out / "tokenizer.json").write_text(tokenizer_json(32000))
    return out


def run(llm: LLM, batch: int, tokens: int, constrained: bool, round_: int, overlap: bool = True) -> float:
    """Output tokens/s of one batch decoded to the end; without `overlap`, the sampler fills the
    masks after the forward pass instead of during it."""
    engine = llm.engine
    sampler = engine.runner.sampler
    sampler.start_masks = type(sampler).start_masks.__get__(sampler) if overlap else (lambda requests: None)
    spec = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        prompt = engine.tokenizer.encode(f"item {i} of round {round_}:")[:8]
        engine.add_request(f"{round_}-{constrained}-{i}", prompt,
                           SamplingParams(max_tokens=tokens, seed=1000 * round_ + i, ignore_eos=True,
                                          structured=spec))
    n = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            n += len(out.new_token_ids)
            assert not constrained or out.finish_reason in (None, "length"), out.finish_reason
    elapsed = time.perf_counter() - t0
    assert n == batch * tokens, (n, batch * tokens)
    return n / elapsed


def paired(llm: LLM, batch: int, tokens: int, round_: int) -> tuple[float, float]:
    """One pair of runs back to back, unconstrained first on even rounds: (free, constrained) tok/s."""
    order = (False, True) if round_ % 2 == 0 else (True, False)
    tok_s = {constrained: run(llm, batch, tokens, constrained, round_) for constrained in order}
    return tok_s[False], tok_s[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, help="report N back-to-back pairs' ratios instead of the rounds' medians")
    args = ap.parse_args()
    print(machine_line(), file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(checkpoint(Path(tmp) / "model")), max_num_seqs=64, max_num_batched_tokens=2048)
        llm.engine.grammars.compile(StructuredOutput("json", json.dumps(SCHEMA)))  # compiled once, up front
        for batch in (int(b) for b in args.batches.split(",")):
            run(llm, batch, 8, False, -1)  # warm-up
            run(llm, batch, 8, True, -1)
            if args.pairs:
                pairs = [paired(llm, batch, args.tokens, r) for r in range(args.pairs)]
                ratios = [c / f for f, c in pairs]
                print(json.dumps({"bench": "structured_decode", "batch": batch, "tokens": args.tokens,
                                  "pairs": pairs, "median_ratio": statistics.median(ratios),
                                  "min_ratio": min(ratios), "max_ratio": max(ratios),
                                  "loadavg": open("/proc/loadavg").read().split()[:3]}))
                continue
            free, constrained, serial = [], [], []
            for r in range(args.rounds):
                free.append(run(llm, batch, args.tokens, False, r))
                constrained.append(run(llm, batch, args.tokens, True, r))
                serial.append(run(llm, batch, args.tokens, True, r, overlap=False))
            rows.append({"batch": batch, "unconstrained_tok_s": statistics.median(free),
                         "constrained_tok_s": statistics.median(constrained),
                         "constrained_serial_tok_s": statistics.median(serial),
                         "ratio": statistics.median(constrained) / statistics.median(free),
                         "ratio_serial": statistics.median(serial) / statistics.median(free),
                         "rounds": {"unconstrained": free, "constrained": constrained, "serial": serial}})
    if not rows:
        return
    print("| batch | unconstrained (tok/s) | JSON schema (tok/s) | ratio "
          "| masks after the forward pass (tok/s) | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['unconstrained_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | {r['ratio']:.3f} "
              f"| {r['constrained_serial_tok_s']:.1f} | {r['ratio_serial']:.3f} |")
    print(json.dumps({"bench": "structured_decode", "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
