"""`pdserve make-model` and `pdserve generate`: checkpoints and offline generation from the shell."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from pdserve.engine.checkpoint import PRESETS

    p = sub.add_parser("make-model", help="write a deterministic random checkpoint in Hugging Face format",
                       description="Write config.json, model.safetensors and a locally trained tokenizer for a "
                                   "preset architecture. Nothing is downloaded.")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="architecture and size")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.set_defaults(handler=_make_model)

    g = sub.add_parser("generate", help="generate completions offline on one engine",
                       description="Run prompts through the engine and print the completions. With no --model "
                                   "the tiny-llama preset is generated on first use into the cache directory "
                                   "($PDSERVE_CACHE_DIR, default ~/.cache/pdserve).")
    g.add_argument("--model", help="local Hugging Face checkpoint directory (default: tiny-llama preset)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    src.add_argument("--prompts-file", help="file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    s.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None, help="return the sampled token's logprob and the top N")
    e = g.add_argument_group("engine")
    e.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes; devices on GPU) the model is split over; gloo on CPU, nccl on CUDA")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: spread whole experts over the ranks instead of splitting each")
    e.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps op by op instead of replaying CUDA graphs")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt per line")
    g.set_defaults(handler=_generate)


def _make_model(args) -> int:
    from pdserve.engine.checkpoint import make_checkpoint

    out = make_checkpoint(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


def _read_prompts(args) -> list[str]:
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    return args.prompt or ["The quick brown fox"]


def _generate(args) -> int:
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.errors import PdserveError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos,
            logprobs=args.logprobs)
        prompts = _read_prompts(args)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                  num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                  enforce_eager=args.enforce_eager)
        try:
            inputs = ([llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
                      if args.chat else prompts)
            outs = llm.generate(inputs, params, use_tqdm=len(prompts) > 1)
        finally:
            llm.engine.shutdown()
    except (PdserveError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        if args.json:
            record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids)}
            if args.logprobs is not None:
                record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                       "top": [[t, v] for t, v in lp.top]} for lp in out.logprobs]
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0
