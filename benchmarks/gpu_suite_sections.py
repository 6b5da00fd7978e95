"""How gpu_suite.py measures each figure: its sections (machine, attention, dense, moe; pd is
gpu_suite_pd.py) and what they share (timing, model directories, driving an engine).

Each section takes the run's shapes (`gpu_suite.Shapes`), the report (`gpu_suite.Report`: `row`,
`figures`, and `limits`, which the machine section fills for the others) and a scratch directory,
and adds rows and figures as it measures, so that a failure later in a section keeps what came
before. What the sections measure and why is in gpu_suite.py's docstring.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_suite import Report, Shapes

SEED = 0  # random_weights.json: every engine and transformers load this one draw


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


_T0 = time.perf_counter()


# -- helpers -------------------------------------------------------------------------------------

def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds_per_call(fn, device: str, iters: int) -> float:
    """Median seconds of `fn()`: CUDA events on a GPU, after three calls that compile and tune;
    the host clock on a CPU (the dry run), after one."""
    import torch

    for _ in range(3 if device.startswith("cuda") else 1):
        fn()
    times = []
    if device.startswith("cuda"):
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def replay_seconds_per_call(fn, device: str, iters: int) -> float | None:
    """Median seconds of `fn` as a decode step runs it on a GPU: captured in a CUDA graph (after
    three eager calls that compile and tune) and replayed, so the host's launch work is off the
    device's path; None on a CPU, or where `fn` cannot be captured (said in the log)."""
    import torch

    if not device.startswith("cuda"):
        return None
    for _ in range(3):
        fn()
    side = torch.cuda.Stream()  # capture wants the eager warm-up off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - the eager figure stands
        log(f"could not capture {fn!r} in a CUDA graph: {e!r}")
        return None
    return seconds_per_call(graph.replay, device, iters)


def free_device_memory(device: str) -> None:
    """Between sections: what the last one held goes back to the device (the P/D section's other
    process allocates outside this process's cache)."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def write_model_dir(path: Path, config: dict, tokenizer) -> Path:
    """config.json, random_weights.json and a small local tokenizer: the engine's ids past the
    tokenizer's vocabulary decode to nothing, which costs the benchmark nothing."""
    from pdserve.engine.checkpoint import BOS, EOS, UNK

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "random_weights.json").write_text(json.dumps({"seed": SEED}))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
         "pad_token": EOS, "add_bos_token": True}))
    return path


def engine_options(sh: Shapes, model_dir: Path, max_num_seqs: int, max_model_len: int, **extra) -> dict:
    # Prefix caching off: a run's prompts never share blocks anyway, and a warm-up or the
    # colocated reference must not leave blocks that a later measurement would hit.
    return dict(model=str(model_dir), dtype=sh.dtype, device=sh.device, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=sh.batched_tokens, kv_cache_memory_bytes=sh.kv_cache_bytes,
                max_model_len=max_model_len, enable_prefix_caching=False, **extra)


def run_requests(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """Greedy generation to exactly max_tokens each (EOS ignored): each prompt's output tokens and
    the seconds of every engine step (a step ends in the host reading the sampled tokens, so its
    wall time covers the device's work)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"req-{next(_request_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    step_s = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - t)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in ids], step_s


_request_ids = iter(range(1 << 62))


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def linear_params_per_layer(arch) -> int:
    """Attention and dense-MLP weights of one layer (the matmuls' parameters)."""
    h, hd = arch.hidden_size, arch.head_dim
    return h * (arch.num_heads + 2 * arch.num_kv_heads) * hd + arch.num_heads * hd * h + 3 * h * arch.intermediate_size


# -- sections ------------------------------------------------------------------------------------

def section_machine(sh: Shapes, rep: Report, work: Path) -> None:
    import torch

    dev = sh.device
    src = torch.empty(sh.copy_bytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda: dst.copy_(src), dev, sh.timing_iters)
    assert torch.equal(dst[:4096], src[:4096])
    rep.limits["copy_bytes_per_s"] = 2 * sh.copy_bytes / copy_s
    rep.figures("machine", copy_bytes=sh.copy_bytes, copy_s=copy_s, copy_bytes_per_s=rep.limits["copy_bytes_per_s"])
    rep.row("machine", f"device-to-device copy of {sh.copy_bytes / 2**30:.3g} GiB, bytes read + written",
            rep.limits["copy_bytes_per_s"] / 1e9, "GB/s")
    n, dtype = sh.matmul_n, getattr(torch, sh.dtype)
    a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    c = torch.empty(n, n, dtype=dtype, device=dev)
    mm_s = seconds_per_call(lambda: torch.mm(a, b, out=c), dev, sh.timing_iters)
    rep.limits["matmul_flops_per_s"] = 2 * n ** 3 / mm_s
    rep.figures("machine", matmul_n=n, matmul_s=mm_s, matmul_flops_per_s=rep.limits["matmul_flops_per_s"])
    rep.row("machine", f"{sh.dtype} matmul {n}x{n}x{n}, random data", rep.limits["matmul_flops_per_s"] / 1e12,
            "TFLOP/s")


def section_attention(sh: Shapes, rep: Report, work: Path) -> None:
    """The kernel a decode step runs per layer, on a cache of shuffled blocks (as a served cache
    is), checked against the torch path once before it is timed."""
    import torch

    from pdserve.engine.kernels import paged_attention, triton_paged

    dev, dtype = sh.device, getattr(torch, sh.dtype)
    arch = sh.dense
    heads, kv_heads, head_dim, block = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"], 16
    batch, scale = sh.attn_batch, arch["head_dim"] ** -0.5
    g = torch.Generator(device=dev).manual_seed(1)
    for ctx in sh.attn_contexts:
        num_blocks = batch * ctx // block
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, dtype=dtype, device=dev, generator=g)
        v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, dtype=dtype, device=dev, generator=g)
        tables = torch.randperm(num_blocks, device=dev, generator=g).view(batch, ctx // block)
        lens = torch.full((batch,), ctx, dtype=torch.long, device=dev)
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device=dev, generator=g)
        if ctx == sh.attn_contexts[0]:
            got = triton_paged.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale).float()
            ref = paged_attention.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                                         scale)
            err = ((got - ref).norm() / ref.norm()).item()
            rep.figures("attention", relative_error_vs_torch=err)
            if not err < 2e-2:
                raise AssertionError(f"Triton decode attention differs from the torch path: relative error {err:.2e}")
        # Timed as a decode step runs it (in a CUDA graph), and as an eager call whose host work the
        # device waits for (the kernels' launch included).
        args = (q, k_cache, v_cache, tables, lens, scale)
        def call(args=args):
            return triton_paged.paged_decode_attention(*args)
        eager = seconds_per_call(call, dev, sh.timing_iters)
        replayed = replay_seconds_per_call(call, dev, sh.timing_iters)
        t = replayed or eager
        kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
        rep.figures("attention", **{f"ctx{ctx}_s": t, f"ctx{ctx}_eager_s": eager, f"ctx{ctx}_replayed_s": replayed,
                                    f"ctx{ctx}_kv_bytes": kv_bytes})
        rep.row("attention", f"paged decode attention, batch {batch}, context {ctx}, K/V bytes read",
                kv_bytes / t / 1e9, "GB/s", rep.limits.get("copy_bytes_per_s", 0) / 1e9, "copy bandwidth", 0.7,
                note=(f"{replayed * 1e6:.0f} us in a CUDA graph, as a decode step runs it; an eager call "
                      f"{eager * 1e6:.0f} us" if replayed else f"{eager * 1e6:.0f} us"))
        # Other partition sizes (blocks), for choosing the rule from data: figures only.
        sweep = {}
        for blocks in (8, 16, 32, 64):
            if blocks <= ctx // block:
                def part(args=args, blocks=blocks):
                    return triton_paged.paged_decode_attention(*args, partition_blocks=blocks)
                sweep[blocks] = replay_seconds_per_call(part, dev, sh.timing_iters) or \
                    seconds_per_call(part, dev, sh.timing_iters)
        rep.figures("attention", **{f"ctx{ctx}_s_by_partition_blocks": sweep})

    # The prefill kernel on one prompt of the dense section's prefill length: its share of that
    # prefill's time, and a check of it in bf16, which no GPU run had before (Triton's
    # interpreter computes bf16 dot products wrongly, so the dry run checks fp32 only).
    n = sh.prefill_tokens
    k_new, v_new = (torch.randn(n, kv_heads, head_dim, dtype=dtype, device=dev, generator=g) for _ in range(2))
    q = torch.randn(n, heads, head_dim, dtype=dtype, device=dev, generator=g)
    table = torch.randperm(n // block, device=dev, generator=g)
    k_cache = torch.empty(n // block, block, kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.empty_like(k_cache)
    k_cache[table], v_cache[table] = k_new.view(-1, block, kv_heads, head_dim), v_new.view(-1, block, kv_heads, head_dim)
    cu, lens = torch.tensor([0, n], device=dev), torch.tensor([n], device=dev)
    args = (q, k_cache, v_cache, cu, lens, table[None], scale)
    got = triton_paged.paged_prefill_attention(*args, max_query_len=n).float()
    ref = paged_attention.paged_prefill_attention(q.float(), k_new.float(), v_new.float(), k_cache.float(),
                                                  v_cache.float(), table, n, scale)
    err = ((got - ref).norm() / ref.norm()).item()
    t = seconds_per_call(lambda: triton_paged.paged_prefill_attention(*args, max_query_len=n), dev, sh.timing_iters)
    flops = 2 * n * n * heads * head_dim  # QK^T and PV over the causal half
    rep.figures("attention", prefill_relative_error_vs_torch=err, prefill_s=t)
    rep.row("attention", f"paged prefill attention, one {n}-token prompt, causal", flops / t / 1e12, "TFLOP/s",
            rep.limits.get("matmul_flops_per_s", 0) / 1e12, "matmul peak", None,
            note=f"{t * 1e3:.2f} ms a layer; relative error vs the torch path {err:.1e}")
    if not err < 2e-2:
        raise AssertionError(f"Triton prefill attention differs from the torch path: relative error {err:.2e}")


def section_gemv(sh: Shapes, rep: Report, work: Path) -> None:
    import torch

    import gpu_suite_gemv  # beside this script

    gpu_suite_gemv.run(rep, sh.dense, sh.device, getattr(torch, sh.dtype), sh.timing_iters, sh.attn_contexts[0])


def section_dense(sh: Shapes, rep: Report, work: Path) -> None:
    from unittest import mock

    import torch

    from pdserve.config import EngineConfig
    from pdserve.engine.kernels import ops, triton_gemv
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.models.arch import ModelArch

    model_dir = write_model_dir(work / "dense", sh.dense, _tokenizer())
    arch = ModelArch.from_dir(model_dir)
    dtype = getattr(torch, sh.dtype)
    elsize = torch.empty((), dtype=dtype).element_size()
    t = time.perf_counter()
    config = EngineConfig(**engine_options(sh, model_dir, max(sh.throughput_batches), sh.prefill_tokens + sh.prompt_tokens))
    on_gemvs = True
    try:
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - the one-token GEMV path's first run on this GPU: the rest need not wait for it
        traceback.print_exc()
        rep.figures("dense", gemv_path_error=repr(e)[:500])
        log("dense: the engine failed to start with one-token steps on triton_gemv; starting it op by op")
        free_device_memory(sh.device)
        on_gemvs = False
        with mock.patch.object(ops, "runs_gemvs", lambda *args: False):
            engine = LLMEngine(config)
    # Weights a decode step reads: every layer's, the final norm, the LM head, one embedding row a token.
    weight_bytes = elsize * (arch.num_layers * (linear_params_per_layer(arch) + 2 * arch.hidden_size)
                             + arch.hidden_size * (2 + arch.vocab_size))
    rep.figures("dense", load_s=time.perf_counter() - t, weight_bytes=weight_bytes,
                cuda_graphs=engine.runner.decode_graphs is not None,
                cuda_graph_sizes=engine.runner.decode_graphs.sizes if engine.runner.decode_graphs else None)
    log(f"dense: engine ready, {weight_bytes / 1e9:.2f} GB of weights a decode step, CUDA graphs "
        f"{'on' if engine.runner.decode_graphs is not None else 'off'}")
    rng = random.Random(0)
    prompts = {b: random_prompts(rng, b, sh.prompt_tokens, arch.vocab_size) for b in sh.throughput_batches}
    run_requests(engine, random_prompts(rng, 2, 16, arch.vocab_size), 4)  # warm-up: kernels, handles

    graphs_on = engine.runner.decode_graphs is not None
    one_prompt = random_prompts(rng, 1, sh.prompt_tokens, arch.vocab_size)
    tokens, step_s = run_requests(engine, one_prompt, sh.output_tokens + 1)
    tok_s = _decode_tokens_per_s(step_s)
    copy_bw = rep.limits.get("copy_bytes_per_s", 0)
    rep.figures("dense", batch1_tokens_per_s=tok_s, batch1_step_ms=[s * 1e3 for s in step_s[1:6]])
    rep.row("dense", "8B-shaped decode, batch 1", tok_s, "tokens/s", copy_bw / weight_bytes,
            "roofline: copy bandwidth / weight bytes", 0.8,
            note=f"{1e3 / tok_s:.2f} ms a step" + (" (one-token steps on triton_gemv)" if graphs_on and on_gemvs else ""))
    # The same prompt with one-token steps op by op (cuBLAS's GEMVs: the engine before triton_gemv),
    # its own batch-1 graph, in this engine: the GEMV path's gain, and its tokens against it.
    op_by_op, op_tokens, op_step_s = _batch1_run(engine, sh, one_prompt, graphs_on,
                                                 mock.patch.object(ops, "runs_gemvs", lambda *args: False))
    op_tok_s = _decode_tokens_per_s(op_step_s)
    same = sum(a == b for a, b in zip(tokens[0], op_tokens[0])) / len(tokens[0])
    rep.figures("dense", batch1_op_by_op_tokens_per_s=op_tok_s, batch1_tokens_equal_op_by_op=same)
    rep.row("dense", "8B-shaped decode, batch 1, one-token steps op by op (cuBLAS's GEMVs)", op_tok_s, "tokens/s",
            copy_bw / weight_bytes, "roofline: copy bandwidth / weight bytes", None,
            note=f"{1e3 / op_tok_s:.2f} ms a step; greedy tokens equal to the GEMV path's on {same:.0%} of "
                 f"{len(tokens[0])} (bf16 rounds in other places)")
    # And on the GEMV path with the gemv section's fastest tiling of each shape, where it is not the
    # engine's rule's: what a rule that picked them would give.
    fastest = rep.data["sections"].get("gemv", {}).get("figures", {}).get("fastest_tiling_by_shape") or {}
    rule, tuned = triton_gemv.tiling, None
    if on_gemvs and any(tuple(t) != rule(*map(int, key.split("x")), torch.device(sh.device))
                        for key, t in fastest.items()):
        def fastest_tiling(n, k, device):
            return tuple(fastest.get(f"{n}x{k}") or rule(n, k, device))

        tuned, tuned_tokens, tuned_step_s = _batch1_run(engine, sh, one_prompt, graphs_on,
                                                        mock.patch.object(triton_gemv, "tiling", fastest_tiling))
        tuned_tok_s = _decode_tokens_per_s(tuned_step_s)
        rep.figures("dense", batch1_fastest_tilings_tokens_per_s=tuned_tok_s, batch1_fastest_tilings=fastest)
        rep.row("dense", "8B-shaped decode, batch 1, on triton_gemv at the gemv section's fastest tiling of each shape",
                tuned_tok_s, "tokens/s", copy_bw / weight_bytes, "roofline: copy bandwidth / weight bytes", None,
                note=f"{1e3 / tuned_tok_s:.2f} ms a step; tokens equal to the rule's tiling's: {tuned_tokens == tokens}")

    ours = {}
    for b in sh.throughput_batches:
        t = time.perf_counter()
        tokens, step_s = run_requests(engine, prompts[b], sh.output_tokens)
        wall = time.perf_counter() - t
        ours[b] = (b * sh.output_tokens / wall, tokens)
        decode_steps = step_s[-(sh.output_tokens // 2):]  # the last half: all b sequences decoding
        rep.figures("dense", **{f"batch{b}_tokens_per_s": ours[b][0], f"batch{b}_wall_s": wall,
                                f"batch{b}_decode_step_ms": 1e3 * statistics.median(decode_steps)})
        log(f"dense: batch {b}: {ours[b][0]:.0f} output tokens/s ({wall:.2f} s, {len(step_s)} steps)")

    prefill_s = []
    for _ in range(4):  # the first warms the kernels' shapes up
        _, step_s = run_requests(engine, random_prompts(rng, 1, sh.prefill_tokens, arch.vocab_size), 1)
        prefill_s.append(sum(step_s))
    n, t = sh.prefill_tokens, statistics.median(prefill_s[1:])
    # Matmuls of every layer, the one row of logits, and causal attention (QK^T and PV over half the square).
    flops = (2 * n * arch.num_layers * linear_params_per_layer(arch) + 2 * arch.hidden_size * arch.vocab_size
             + 2 * arch.num_layers * n * n * arch.num_heads * arch.head_dim)
    peak = rep.limits.get("matmul_flops_per_s", 0)
    rep.figures("dense", prefill_s=prefill_s, prefill_flops=flops, prefill_tokens_per_s=n / t)
    rep.row("dense", f"8B-shaped prefill of {n} tokens (MFU)", flops / t / 1e12, "TFLOP/s", peak / 1e12,
            "matmul peak", 0.5, note=f"{n / t:,.0f} tokens/s, {t * 1e3:.0f} ms")
    graphs = engine.runner.decode_graphs
    if graphs is not None and 1 in graphs._graphs:
        # The device's share of a batch-1 step: its graph replayed alone (the rest of a step is the
        # host's: scheduling, inputs, sampling), both ways. Last: a replay writes a K/V slot no
        # request owns.
        replay_s = seconds_per_call(graphs._graphs[1].replay, sh.device, sh.timing_iters)
        op_replay_s = seconds_per_call(op_by_op._graphs[1].replay, sh.device, sh.timing_iters)
        if tuned is not None:
            rep.figures("dense", batch1_fastest_tilings_replay_s=seconds_per_call(tuned._graphs[1].replay, sh.device,
                                                                                 sh.timing_iters))
        rep.figures("dense", batch1_replay_s=replay_s, batch1_op_by_op_replay_s=op_replay_s)
        rep.row("dense", "8B-shaped decode step, batch 1, its CUDA graph replayed alone (weight bytes read)",
                weight_bytes / replay_s / 1e9, "GB/s", copy_bw / 1e9, "copy bandwidth", 0.8,
                note=f"{replay_s * 1e3:.2f} ms of the {1e3 / tok_s:.2f} ms step; op by op "
                     f"{op_replay_s * 1e3:.2f} ms ({weight_bytes / op_replay_s / copy_bw:.2f})")
    del engine
    free_device_memory(sh.device)

    try:
        baseline = _transformers_throughput(sh, rep, model_dir, arch, prompts)
    except Exception as e:  # noqa: BLE001 - the engine's rows stand without their baseline
        traceback.print_exc()
        rep.figures("dense", transformers_error=repr(e)[:500])
        baseline = {}
    for b in sh.throughput_batches:
        theirs = baseline.get(b)
        note = ""
        if theirs is not None:
            first_equal = sum(a[0] == c[0] for a, c in zip(ours[b][1], theirs[1])) / b
            same = sum(x == y for a, c in zip(ours[b][1], theirs[1]) for x, y in zip(a, c)) / (b * sh.output_tokens)
            rep.figures("dense", **{f"batch{b}_first_token_equal_transformers": first_equal,
                                    f"batch{b}_tokens_equal_transformers": same})
            note = f"same weights: first tokens equal on {first_equal:.0%} of prompts, all on {same:.0%}"
        rep.row("dense", f"8B-shaped output throughput, batch {b}, {sh.prompt_tokens}+{sh.output_tokens} tokens",
                ours[b][0], "tokens/s", theirs[0] if theirs else None, "transformers generate",
                3.0 if b == 64 else None, note)


def _decode_tokens_per_s(step_s: list[float]) -> float:
    """One sequence's decode steps a second: every step but the first (its prefill)."""
    return (len(step_s) - 1) / sum(step_s[1:])


def _batch1_run(engine, sh: Shapes, prompt: list[list[int]], graphs_on: bool, patch):
    """(graphs, tokens, step seconds): a batch-1 decode graph of the engine's model captured under
    `patch` (a context manager changing what a step runs; eager on a CPU), and `prompt` run on it
    with the engine's own graphs set aside."""
    from pdserve.engine.cuda_graphs import DecodeGraphs

    with patch:
        graphs = DecodeGraphs(engine.model, engine.kv_cache, 1, -(-engine.max_model_len // engine.kv_cache.block_size),
                              sh.device)
        if graphs_on:
            graphs.capture()
        own, engine.runner.decode_graphs = engine.runner.decode_graphs, graphs
        try:
            tokens, step_s = run_requests(engine, prompt, sh.output_tokens + 1)
        finally:
            engine.runner.decode_graphs = own
    return graphs, tokens, step_s


def _transformers_throughput(sh: Shapes, rep: Report, model_dir: Path, arch, prompts: dict) -> dict:
    """batch -> (output tokens/s, tokens) of transformers' `generate` on the engine's weights;
    a batch that fails is left out (its row then has no baseline)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    from pdserve.engine.models.loader import random_weights

    dtype = getattr(torch, sh.dtype)
    t = time.perf_counter()
    with torch.device(sh.device):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir),
                                                           dtype=dtype)
    params = dict(hf.named_parameters())
    loaded = set()
    for name, tensor in random_weights(arch, dtype, sh.device, SEED):
        params[name].data.copy_(tensor)
        loaded.add(name)
    if loaded != set(params):
        raise AssertionError(f"transformers' parameters not drawn: {sorted(set(params) - loaded)[:3]}")
    hf.eval()
    rep.figures("dense", transformers_version=transformers.__version__, transformers_load_s=time.perf_counter() - t,
                transformers_attention=getattr(hf.config, "_attn_implementation", None))

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(batch, device=sh.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n, "transformers stopped early"
        return out[:, ids.shape[1]:].tolist()

    generate(prompts[sh.throughput_batches[0]][:2], 4)  # warm-up
    results = {}
    for b in sh.throughput_batches:
        try:
            sync(sh.device)
            t = time.perf_counter()
            tokens = generate(prompts[b], sh.output_tokens)
            wall = time.perf_counter() - t
            results[b] = (b * sh.output_tokens / wall, tokens)
            rep.figures("dense", **{f"transformers_batch{b}_tokens_per_s": results[b][0],
                                    f"transformers_batch{b}_wall_s": wall})
            log(f"dense: transformers batch {b}: {results[b][0]:.0f} output tokens/s ({wall:.2f} s)")
        except Exception as e:  # noqa: BLE001 - the engine's figure stands without its baseline
            log(f"dense: transformers batch {b} failed: {e!r}")
            rep.figures("dense", **{f"transformers_batch{b}_error": repr(e)})
            free_device_memory(sh.device)
    return results


def section_moe(sh: Shapes, rep: Report, work: Path) -> None:
    import torch

    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kernels import triton_moe
    from pdserve.engine.kernels.triton_paged import _pow2
    from pdserve.engine.models.arch import ModelArch

    model_dir = write_model_dir(work / "moe", sh.moe, _tokenizer())
    arch = ModelArch.from_dir(model_dir)
    dtype = getattr(torch, sh.dtype)
    elsize = torch.empty((), dtype=dtype).element_size()
    prompt_tokens, max_len = 16, 16 + sh.moe_steps + 8
    engine = LLMEngine(EngineConfig(**engine_options(sh, model_dir, max(sh.moe_batches), max_len,
                                                     num_kv_blocks=max(sh.moe_batches) * -(-max_len // 16) + 16)))
    h, hd, k = arch.hidden_size, arch.head_dim, arch.num_experts_per_tok
    attention = h * (arch.num_heads + 2 * arch.num_kv_heads) * hd + arch.num_heads * hd * h
    # What a step reads besides experts: attention, norms and router of every layer, the final
    # norm, the LM head, an embedding row a token; and each chosen expert's three matrices.
    fixed_bytes = elsize * (arch.num_layers * (attention + 2 * h + arch.num_experts * h) + h * (2 + arch.vocab_size))
    expert_bytes = elsize * 3 * arch.intermediate_size * h
    rep.figures("moe", architecture="Mixtral-style MoE at Qwen3-30B-A3B shapes, "
                f"{arch.num_layers} layers", non_expert_bytes=fixed_bytes, expert_bytes=expert_bytes,
                cuda_graphs=engine.runner.decode_graphs is not None)
    moe_blocks = [layer.mlp for layer in engine.model.model.layers]
    rng = random.Random(1)
    copy_bw = rep.limits.get("copy_bytes_per_s", 0)
    run_requests(engine, random_prompts(rng, 2, 8, arch.vocab_size), 3)  # warm-up
    for b in sh.moe_batches:
        prompts = random_prompts(rng, b, prompt_tokens, arch.vocab_size)
        # Distinct experts each layer's router picks in a decode step (rows == b), counted in a
        # run of their own: the count reads the device.
        chosen: list[int] = []

        def count(module, inputs, logits, b=b, chosen=chosen):
            if logits.shape[0] == b:
                chosen.append(logits.topk(k, dim=-1).indices.unique().numel())

        hooks = [m.gate.register_forward_hook(count) for m in moe_blocks]
        graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None  # replays run no hooks
        try:
            run_requests(engine, prompts, sh.moe_steps + 1)
        finally:
            engine.runner.decode_graphs = graphs
            for hook in hooks:
                hook.remove()
        experts_per_layer = statistics.mean(chosen)
        _, step_s = run_requests(engine, prompts, sh.moe_steps + 1)  # the same prompts: the same routing
        step = statistics.median(step_s[1:])  # the first step prefills every prompt
        step_bytes = fixed_bytes + arch.num_layers * experts_per_layer * expert_bytes
        rep.figures("moe", **{f"batch{b}_step_s": step, f"batch{b}_step_bytes": step_bytes,
                              f"batch{b}_experts_per_layer": experts_per_layer})
        rep.row("moe", f"MoE decode step, batch {b}", b / step, "tokens/s", copy_bw * b / step_bytes,
                "roofline: copy bandwidth / bytes a step reads", None,
                note=f"{step * 1e3:.1f} ms a step, {step_bytes / 1e9:.3g} GB, {experts_per_layer:.0f} of "
                     f"{arch.num_experts} experts a layer")

        x = torch.randn(b, h, dtype=dtype, device=sh.device)
        block = moe_blocks[0]
        with torch.inference_mode():
            distinct = block.gate(x).topk(k, dim=-1).indices.unique().numel()
            def call(x=x, block=block):
                return block(x)
            eager = seconds_per_call(call, sh.device, sh.timing_iters)
            replayed = replay_seconds_per_call(call, sh.device, sh.timing_iters)
            # Beside it, the experts' GEMMs with the tiles of every batch before choose_block_n
            # (64 outputs a program, at least 16, at most the outputs' power of two).
            rule, triton_moe.choose_block_n = triton_moe.choose_block_n, lambda n, *_: min(64, max(16, _pow2(n)))
            try:
                wide = replay_seconds_per_call(call, sh.device, sh.timing_iters)
            finally:
                triton_moe.choose_block_n = rule
        t = replayed or eager
        block_bytes = elsize * arch.num_experts * h + distinct * expert_bytes
        rep.figures("moe", **{f"block_batch{b}_s": t, f"block_batch{b}_eager_s": eager,
                              f"block_batch{b}_replayed_s": replayed, f"block_batch{b}_64_wide_tiles_s": wide,
                              f"block_batch{b}_bytes": block_bytes})
        rep.row("moe", f"MoE block alone (router + {distinct} experts), batch {b}", block_bytes / t / 1e9, "GB/s",
                copy_bw / 1e9, "copy bandwidth", None,
                note=(f"{replayed * 1e6:.0f} us in a CUDA graph; an eager call {eager * 1e6:.0f} us" if replayed
                      else f"{t * 1e6:.0f} us") + (f"; 64-wide tiles {wide * 1e6:.0f} us" if wide else ""))


def section_pd(sh: Shapes, rep: Report, work: Path) -> None:
    import gpu_suite_pd  # beside this script

    config = {**sh.dense, "num_hidden_layers": sh.pd_layers}
    model_dir = write_model_dir(work / "pd", config, _tokenizer())
    rng = random.Random(2)
    prompts = random_prompts(rng, sh.pd_prompts, sh.pd_prompt_tokens, config["vocab_size"])
    max_len = sh.pd_prompt_tokens + sh.pd_output_tokens + 16
    options = engine_options(sh, model_dir, sh.pd_prompts, max_len,
                             num_kv_blocks=sh.pd_prompts * -(-max_len // 16) + 16)
    gpu_suite_pd.run(rep, options, prompts, sh.pd_output_tokens, log)


_TOKENIZER = None


def _tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from pdserve.engine.checkpoint import build_tokenizer

        _TOKENIZER = build_tokenizer(512)
    return _TOKENIZER
