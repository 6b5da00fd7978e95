"""`pdserve simulate calibrate`: fit the `cpu` profile to this machine's real engine.

It runs pdserve's engine (one thread, as a one-core replica of the serving benchmarks) on a model
(default: the `serve-llama-40m` preset the serving benchmarks stream), times whole engine steps
(`LLMEngine.step`: scheduling, the forward pass, sampling, outputs) of pure decode at several
batch sizes and contexts and of single prefills of several lengths, and fits the additive
roofline's effective rates to them (`fit`: streaming weights, FLOPs, reading KV in attention;
least relative squared error). A memory copy's rate
stands in for the link (the same-host KV path copies blocks). Out: a JSON file with the profile,
every sample with its fitted prediction, the engine settings and the machine line.

The fit is pure (`fit`); only `measure` needs torch and the engine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdserve.simulate.hardware import Accelerator
from pdserve.simulate.model import ModelSpec
from pdserve.simulate.roofline import prefill_pairs

DECODE_CASES = ((1, 128), (8, 128), (32, 128), (1, 1024), (16, 1024))
PREFILL_LENGTHS = (32, 128, 512, 1024)


def machine_line() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.node()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, "
            f"Python {platform.python_version()}")


def _sample(kind: str, num_tokens: int, kv_tokens: int, pairs: float, seconds: float, **what) -> dict:
    return {"kind": kind, "num_tokens": num_tokens, "kv_tokens": kv_tokens, "pairs": pairs, "seconds": seconds,
            **what}


def measure(model_dir: str, num_threads: int = 1, steps: int = 12, repeats: int = 5,
            progress=None) -> tuple[list, dict]:
    """Time the engine's steps; returns (samples, engine settings). Each case is measured
    `repeats` times, the cases taking turns, and keeps its fastest (`seconds`; every measurement
    in `all_seconds`): on a shared machine the other loads only ever slow a step down."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    settings = {"num_threads": num_threads, "max_num_seqs": 64, "kv_cache_memory_bytes": 512 * 2**20,
                "max_num_batched_tokens": 2048}
    engine = LLM(model_dir, **settings).engine
    vocab = engine.tokenizer.vocab_size
    serial = [0]

    def prompt(n: int) -> list[int]:  # distinct prompts: no prefix hits between samples
        serial[0] += 1
        return [5 + (7919 * serial[0] + 31 * t) % (vocab - 5) for t in range(n)]

    def add(n: int, max_tokens: int) -> None:
        engine.add_request(f"cal-{serial[0]}", prompt(n), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    samples: dict[tuple, dict] = {}

    def record(key: tuple, sample: dict) -> None:
        if key not in samples:
            samples[key] = {**sample, "all_seconds": []}
        samples[key]["all_seconds"].append(sample["seconds"])
        samples[key]["seconds"] = min(samples[key]["all_seconds"])

    add(64, 4)  # warm-up
    drain()
    for _ in range(repeats):
        for n in PREFILL_LENGTHS:
            add(n, 1)
            t = time.perf_counter()
            engine.step()
            record(("prefill", n), _sample("prefill", n, n, prefill_pairs(0, n), time.perf_counter() - t,
                                           prompt_tokens=n))
            drain()
            progress and progress()
        for batch, context in DECODE_CASES:
            for _ in range(batch):
                add(context, steps + 4)
            while engine.scheduler.waiting or any(s.num_output_tokens < 2 for s in engine.scheduler.running):
                engine.step()  # the prefills and the first decode step
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            kv = batch * (context + 2 + steps // 2)  # the contexts at the middle timed step
            record(("decode", batch, context),
                   _sample("decode", batch, kv, kv, statistics.median(times), batch=batch, context=context))
            drain()
            progress and progress()
    engine.shutdown()
    return list(samples.values()), settings


def copy_bytes_per_s(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src, dst = np.ones(num_bytes, np.uint8), np.empty(num_bytes, np.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return num_bytes / statistics.median(times)


def _parts(model: ModelSpec, samples: list[dict]) -> np.ndarray:
    """Each sample's [weight bytes, FLOPs, KV bytes] (rows)."""
    return np.array([[model.weight_bytes_read(s["num_tokens"]),
                      s["num_tokens"] * model.flops_per_token + s["pairs"] * model.attention_flops_per_pair,
                      s["kv_tokens"] * model.kv_bytes_per_token] for s in samples])


def fit(model: ModelSpec, samples: list[dict]) -> tuple[float, float, float]:
    """(weight bytes/s, FLOP/s, KV bytes/s) of the additive model t = W / bw + F / peak + KV / attn,
    by least relative squared error (a linear fit in the reciprocals). A dense model streams the
    same weights every step, so a fixed per-step cost cannot be told from the weights' and is
    charged to their bandwidth."""
    x = _parts(model, samples)
    t = np.array([s["seconds"] for s in samples])
    coef, *_ = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)
    if np.any(coef <= 0):
        raise ValueError(f"the samples do not fit an additive roofline (reciprocal rates {coef}); measure again "
                         "on a quieter machine")
    return tuple(float(1.0 / c) for c in coef)


def predict(model: ModelSpec, samples: list[dict], bw: float, peak: float, attention_bw: float) -> list[float]:
    return (_parts(model, samples) @ np.array([1 / bw, 1 / peak, 1 / attention_bw])).tolist()


def calibrate(model_name: str, out: Path, num_threads: int = 1, progress: bool = True) -> dict:
    from tqdm import tqdm

    from pdserve.engine.checkpoint import PRESETS, default_model
    from pdserve.simulate.model import load_model

    model_dir = str(default_model(model_name)) if model_name in PRESETS else model_name
    spec = load_model(model_dir)
    bar = tqdm(total=5 * (len(PREFILL_LENGTHS) + len(DECODE_CASES)), desc="calibrating", unit="case",
               disable=not progress)
    try:
        samples, settings = measure(model_dir, num_threads, progress=lambda: bar.update(1))
    finally:
        bar.close()
    bw, peak, attention_bw = fit(spec, samples)
    link = copy_bytes_per_s()
    for s, p in zip(samples, predict(spec, samples, bw, peak, attention_bw)):
        s["predicted_seconds"] = p
    profile = Accelerator("cpu", bw, peak, link, link, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                          kv_cache_bytes=float(settings["kv_cache_memory_bytes"]),
                          source=f"calibrated on {model_name}, {num_threads} engine thread(s)",
                          attention_bytes_per_s=attention_bw, is_additive=True)
    errors = [abs(s["predicted_seconds"] / s["seconds"] - 1) for s in samples]
    result = {"machine": machine_line(), "load_average": os.getloadavg(),
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "model": model_name, "engine": settings, "profile": asdict(profile),
              "fit": {"median_abs_rel_error": statistics.median(errors), "max_abs_rel_error": max(errors)},
              "samples": samples}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result
