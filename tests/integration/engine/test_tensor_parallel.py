"""Tensor- and expert-parallel engines on CPU (gloo, ranks as local processes) match one rank
token for token, and fail clearly when they cannot run."""

from __future__ import annotations

import time

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import UnsupportedModelError

PROMPTS = [[5, 17, 99, 3, 44, 7, 8, 9, 10, 11, 12], list(range(20, 70)), [300, 301, 7], list(range(20, 45))]


def generate(model: str, **options) -> dict[str, tuple[list[int], list]]:
    """Greedy outputs (and prompt logprobs of one request) of a small batch: chunked prefill, a
    shared prefix (prompts 1 and 3), decode batches."""
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                                    num_threads=1, **options))
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                          prompt_logprobs=2 if i == 0 else None))
        outs: dict[str, list[int]] = {}
        logprobs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.prompt_logprobs:
                    logprobs[o.request_id] = o.prompt_logprobs
        if options.get("tensor_parallel_size", 1) > 1:
            assert engine.model.num_kv_heads == 1  # 2 KV heads, one per rank
        return {r: (outs[r], logprobs.get(r)) for r in outs}
    finally:
        engine.shutdown()


def same_tokens_close_logprobs(a, b):
    for r in a:
        assert a[r][0] == b[r][0], r
        if a[r][1] is not None:
            for x, y in zip(a[r][1][1:], b[r][1][1:]):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_tp2_matches_tp1(checkpoints, preset):
    model = checkpoints[preset]
    same_tokens_close_logprobs(generate(model), generate(model, tensor_parallel_size=2))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2-experts-split", "ep2"])
def test_moe_parallel_matches_one_rank(checkpoints, expert_parallel):
    model = checkpoints["tiny-mixtral"]
    same_tokens_close_logprobs(generate(model),
                               generate(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel))


def test_a_degree_the_model_cannot_split_fails_before_any_rank_starts(tiny_llama):
    t0 = time.monotonic()
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 3 .* 4 attention heads"):
        LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16, tensor_parallel_size=3))
    assert time.monotonic() - t0 < 10


def test_a_dead_worker_rank_fails_the_engine_instead_of_hanging(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, block_size=8, num_threads=1,
                                    tensor_parallel_size=2))
    try:
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0))
        engine.step()
        engine._local_workers[0].kill()
        engine._local_workers[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t0 < 60
    finally:
        engine._stop_workers(graceful=False)


def test_generate_cli_with_two_ranks(tiny_llama, capsys):
    from pdserve.cli import main

    args = ["generate", "--model", tiny_llama, "--prompt", "Hello there", "--max-tokens", "8", "--json",
            "--ignore-eos", "--num-kv-blocks", "32"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one
