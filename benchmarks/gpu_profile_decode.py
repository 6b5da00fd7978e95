"""Where a batch-1 decode step of the 8B-shaped model spends its device time: the engine's eager
step (`enforce_eager`, so each kernel is its own launch) under torch's profiler, kernels ranked
by device time, with the bytes each class of kernel should read at the copy bandwidth.

    python benchmarks/gpu_profile_decode.py [--dry-run] [--out DIR]

Runs with `benchmarks/gpu_suite.sh`'s environment (random bf16 weights drawn on the GPU; no
checkpoint). Prints the table and writes it to DIR/profile.txt.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from gpu_suite import FULL, TINY  # this folder's scripts run with it on sys.path
from gpu_suite_sections import _tokenizer, engine_options, random_prompts, run_requests, write_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default="gpu-out")
    args = parser.parse_args()
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    sh = TINY if args.dry_run else FULL
    work = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    model_dir = write_model_dir(work / "dense", sh.dense, _tokenizer())
    engine = LLMEngine(EngineConfig(**engine_options(sh, model_dir, 4, sh.prompt_tokens + 64, enforce_eager=True)))
    rng = random.Random(0)
    run_requests(engine, random_prompts(rng, 1, sh.prompt_tokens, sh.dense["vocab_size"]), 8)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if sh.device.startswith("cuda") else [])
    from pdserve.engine.sampling_params import SamplingParams

    engine.add_request("p", random_prompts(rng, 1, sh.prompt_tokens, sh.dense["vocab_size"])[0],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    with profile(activities=activities) as prof:
        for _ in range(10):  # ten decode steps
            engine.step()
    key = "self_device_time_total" if sh.device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90)
    print(table)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile.txt").write_text(table)


if __name__ == "__main__":
    main()
