"""Issue #47 on one lent GPU, in one run: the machine's limits, an 8B-class model against them and
against `transformers`, the paged decode attention kernel, a MoE decode step, and P/D with the KV
pulled between two processes.

    python benchmarks/gpu_suite.py [--out DIR] [--sections machine,attention,gemv,dense,moe,pd] [--dry-run]

(--sections reruns some of them, e.g. machine,pd: the machine's figures are the others' limits.)

benchmarks/gpu_suite.sh brings what the GPU image lacks (UCX for CUDA 13, pydantic) and runs this.
Nothing is downloaded and no weights are read: each model is a config.json with
`random_weights.json` beside it (engine/models/loader.py draws the weights on the device), and
`transformers` loads the very same draw.

Sections, in this order, each in its own try (one failure keeps the others' figures):
- machine: device-to-device copy bandwidth (bytes read + bytes written per second) and a bf16
  matmul's TFLOP/s; the yardsticks of the other sections, measured in the same run.
- attention: the Triton paged decode attention kernel at 8B shapes (batch 64, contexts 1k-8k, 32
  query / 8 KV heads of 128, bf16), K/V bytes read per second against the copy bandwidth, timed
  as a decode step runs it (replayed in a CUDA graph; the eager call beside it).
- gemv: a layer's four weight GEMVs at batch 1, cuBLAS against the engine's Triton GEMV
  (`triton_gemv`) at a few tilings, and a whole batch-1 layer both ways (op by op, and with the
  norms, rotary, the K/V write, SwiGLU and the residual adds read into the GEMVs)
  (gpu_suite_gemv.py).
- dense: a Llama-3-8B-shaped model on pdserve's engine, CUDA graphs on: batch-1 decode against the
  roofline (copy bandwidth / weight bytes: a decode step reads every weight once), on the one-token
  GEMV path and op by op (a second batch-1 graph of the same engine, the same prompt), output
  throughput at batch 64 and 256 against `transformers` `generate` on the same weights, prompts
  and lengths, and a 4,096-token prefill against the matmul peak (MFU).
- moe: decode steps at Qwen3-30B-A3B's shapes with 4 of its 48 layers, on pdserve's Mixtral-style
  MoE (the Mixtral architecture at its shapes: Qwen3-MoE's own model adds only per-head q/k norms,
  and the runs before it was built stay comparable), against the bytes a step must read:
  attention, router, LM head and the experts its tokens chose. And the MoE block alone against
  the router's and chosen experts' bytes (replayed in a CUDA graph, the eager call beside it).
- pd: prefill and decode engines in two processes, the KV pulled between them by every path
  (torch's CUDA IPC, UCX, the tcp backend, pdserve's local read), and their greedy tokens against
  two references (gpu_suite_pd.py).
This file is the run and its report; the sections are in gpu_suite_sections.py beside it.

Out, under --out (default $OUT, else ./gpu-out): gpu_suite.json, rewritten after every figure so
that a run cut short keeps what it measured (device, driver, torch, CUDA; each section's status,
seconds, figures and error; the rows), and gpu_suite.md, the rows as a table: metric, value,
limit or baseline, ratio, target, met?. Progress goes to stdout as it happens.

`--dry-run` runs the same code at tiny shapes on the CPU (fp32; `transformers` on the CPU; Triton
under its interpreter; the KV over UCX's TCP transport): tests/integration/test_gpu_suite_dry_run.py
runs it so that the script cannot rot between GPU lends. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform as std_platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import gpu_suite_sections as measure  # beside this script: how each figure is measured
from gpu_suite_sections import log

SECTIONS = ("machine", "attention", "gemv", "dense", "moe", "pd")
# About what each section takes on an H100 (estimated, not yet measured). At twice this the
# section's thread stacks are dumped to stderr, so that a hang says where; nothing is stopped.
EXPECTED_S = {"machine": 15, "attention": 30, "gemv": 30, "dense": 150, "moe": 45, "pd": 90}


@dataclass(frozen=True)
class Shapes:
    """What one run measures: the GPU's shapes (`FULL`) or the dry run's (`TINY`)."""
    device: str
    dtype: str  # EngineConfig's name of it
    copy_bytes: int  # each of the copy's source and destination
    matmul_n: int
    dense: dict  # config.json of the dense model
    prompt_tokens: int  # throughput and batch-1 prompts
    output_tokens: int
    throughput_batches: tuple[int, ...]
    prefill_tokens: int
    batched_tokens: int  # the engine's step budget: a whole prefill_tokens prompt in one step
    kv_cache_bytes: int
    attn_batch: int
    attn_contexts: tuple[int, ...]
    moe: dict  # config.json of the MoE model
    moe_batches: tuple[int, ...]
    moe_steps: int
    pd_layers: int  # of the dense shape
    pd_prompts: int
    pd_prompt_tokens: int
    pd_output_tokens: int
    timing_iters: int = 20


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int, max_position: int, rope_theta: float, dtype: str, **extra) -> dict:
    # No eos_token_id: transformers' generate then runs every prompt to max_new_tokens, as the
    # engine does with ignore_eos, without masking a token out as min_new_tokens would.
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_act": "silu", "max_position_embeddings": max_position, "rms_norm_eps": 1e-5,
            "rope_theta": rope_theta, "tie_word_embeddings": False, "torch_dtype": dtype, **extra}


def moe_config(experts: int, top_k: int, **dense) -> dict:
    return {**llama_config(**dense), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": experts, "num_experts_per_tok": top_k}


FULL = Shapes(
    device="cuda:0", dtype="bfloat16", copy_bytes=2 << 30, matmul_n=8192,
    # Llama-3-8B.
    dense=llama_config(4096, 14336, 32, 32, 8, 128, 128256, 8192, 500000.0, "bfloat16"),
    prompt_tokens=128, output_tokens=128, throughput_batches=(64, 256), prefill_tokens=4096,
    batched_tokens=8192, kv_cache_bytes=10 << 30,  # 256 x 256 tokens at 128 KiB a token: 8 GiB
    attn_batch=64, attn_contexts=(1024, 2048, 4096, 8192),
    # Qwen3-30B-A3B: 128 experts of 768, top 8, hidden 2048, 32 query / 4 KV heads of 128.
    moe=moe_config(128, 8, hidden=2048, intermediate=768, layers=4, heads=32, kv_heads=4, head_dim=128,
                   vocab=151936, max_position=4096, rope_theta=1000000.0, dtype="bfloat16"),
    moe_batches=(1, 64), moe_steps=16,
    # 8 of the 8B's layers: a 4,096-token prompt's KV is 128 MiB, as a 1,024-token one's of the 8B.
    pd_layers=8, pd_prompts=16, pd_prompt_tokens=4096, pd_output_tokens=32)

TINY = Shapes(
    device="cpu", dtype="float32", copy_bytes=16 << 20, matmul_n=256,
    # Vocabularies past the tokenizer's 512, as the GPU's are: ids with no text on the way out.
    dense=llama_config(64, 128, 2, 4, 2, 16, 1000, 512, 500000.0, "float32"),
    prompt_tokens=16, output_tokens=8, throughput_batches=(4, 8), prefill_tokens=64,
    batched_tokens=256, kv_cache_bytes=8 << 20,
    attn_batch=2, attn_contexts=(32, 64),
    moe=moe_config(8, 2, hidden=64, intermediate=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                   vocab=1000, max_position=512, rope_theta=1000000.0, dtype="float32"),
    moe_batches=(1, 4), moe_steps=4,
    pd_layers=2, pd_prompts=3, pd_prompt_tokens=40, pd_output_tokens=8, timing_iters=3)


# -- the report ---------------------------------------------------------------------------------

@dataclass
class Report:
    """The run's figures and rows, written out after every change (json, then the table)."""
    out_dir: Path
    data: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)  # copy_bytes_per_s, matmul_flops_per_s, once measured

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {"status": "not run", "figures": {}})

    def figures(self, section: str, **values) -> None:
        self.section(section)["figures"].update(values)
        self.write()

    def row(self, section: str, metric: str, value: float, unit: str, limit: float | None = None,
            limit_name: str = "", target: float | None = None, note: str = "") -> None:
        """One table row; `ratio` is value / limit, `met` is ratio >= target where both exist."""
        ratio = value / limit if limit else None
        self.data["rows"].append({
            "section": section, "metric": metric, "value": value, "unit": unit, "limit": limit,
            "limit_name": limit_name, "ratio": ratio, "target": target, "note": note,
            "met": None if target is None or ratio is None else ratio >= target})
        log(f"{metric}: {value:.4g} {unit}" + (f" ({ratio:.2f} of {limit_name})" if ratio is not None else ""))
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / "gpu_suite.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out_dir / "gpu_suite.json")
        (self.out_dir / "gpu_suite.md").write_text(self.markdown())

    def markdown(self) -> str:
        env = self.data["env"]
        title = (f"gpu_suite on {env.get('device_name')} (driver {env.get('driver')}, torch {env.get('torch')}, "
                 f"CUDA {env.get('cuda')}){' -- DRY RUN, tiny shapes on the CPU' if self.data['dry_run'] else ''}")
        lines = [title, "", "| metric | value | limit / baseline | ratio | target | met? |", "|---|---|---|---|---|---|"]
        for r in self.data["rows"]:
            limit = f"{_fmt(r['limit'])} ({r['limit_name']})" if r["limit"] else "-"
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            target = f">= {r['target']:g}" if r["target"] is not None else "-"
            met = {True: "yes", False: "NO", None: "-"}[r["met"]]
            note = f" ({r['note']})" if r["note"] else ""
            lines.append(f"| {r['metric']}{note} | {_fmt(r['value'])} {r['unit']} | {limit} | {ratio} | {target} | {met} |")
        lines += ["", "| section | status | seconds |", "|---|---|---|"]
        for name, s in self.data["sections"].items():
            status = s["status"] + (f": {s['error']}" if s.get("error") else "")
            lines.append(f"| {name} | {status.replace('|', '/')} | {s.get('seconds', 0):.1f} |")
        return "\n".join(lines) + "\n"


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


# -- the run -------------------------------------------------------------------------------------

def environment(sh: Shapes) -> dict:
    import torch

    env = {"python": sys.version.split()[0], "host": std_platform.node(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": sh.device}
    # Versions from the installed metadata: importing ucxx here would load UCX before any CUDA context.
    for name, dists in (("triton", ["triton"]), ("transformers", ["transformers"]),
                        ("ucxx", ["ucxx-cu13", "ucxx-cu12", "ucxx"])):
        env[name] = next((v for v in map(_version, dists) if v), "not installed")
    if sh.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, device_memory_gib=props.total_memory / 2**30,
                   multiprocessors=props.multi_processor_count)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           check=False, capture_output=True, text=True,
                                           timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown: {e!r}"
    else:
        env.update(device_name=f"CPU ({os.cpu_count()} cores)", driver=None)
    return env


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-out", help="where the JSON and table go")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated subset, run in the order above (to rerun one that failed; "
                         "without machine the rows have no limits)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (the test suite's run)")
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    sh = TINY if args.dry_run else FULL
    if args.dry_run:
        # Before anything imports Triton: its kernels run in the interpreter on the CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("UCX_TLS", "tcp")
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if sh.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    rep = Report(Path(args.out))
    rep.data = {"suite": "benchmarks/gpu_suite.py (issue #47)", "dry_run": args.dry_run,
                "started_unix_s": time.time(), "env": environment(sh), "shapes": sh.__dict__,
                "sections": {}, "rows": []}
    rep.write()
    log(f"gpu_suite on {rep.data['env']['device_name']}: sections {', '.join(sections)}")
    runners = {"machine": measure.section_machine, "attention": measure.section_attention,
               "gemv": measure.section_gemv, "dense": measure.section_dense, "moe": measure.section_moe,
               "pd": measure.section_pd}
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as work:
        for name in sections:
            s = rep.section(name)
            s["status"] = "running"
            log(f"== {name}")
            faulthandler.dump_traceback_later(EXPECTED_S[name] * 2, exit=False)
            t = time.perf_counter()
            try:
                runners[name](sh, rep, Path(work))
                s["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
                traceback.print_exc()
                s["status"], s["error"] = "error", repr(e)[:500]
            finally:
                faulthandler.cancel_dump_traceback_later()
                s["seconds"] = time.perf_counter() - t
                measure.free_device_memory(sh.device)
                rep.write()
            log(f"== {name}: {s['status']} in {s['seconds']:.1f} s")
    print(rep.markdown(), flush=True)
    return 0 if all(rep.section(n)["status"] == "ok" for n in sections) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: exit without waiting on UCX's and the engines' threads, which can
    # keep an interpreter from ending.
    os._exit(code)
