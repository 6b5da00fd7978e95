"""Greedy output is token-identical to transformers' `generate`, whatever the batching does."""

import random

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import TINY_PRESETS

PROMPT_LENS = [1, 2, 15, 16, 17, 40, 100, 150, 300]
MAX_NEW = 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]


_reference_cache: dict[str, list[list[int]]] = {}


def _reference(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """transformers' greedy continuation of each prompt, run one at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    if path not in _reference_cache:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False)
            outs.append(gen[0, len(p):].tolist())
        _reference_cache[path] = outs
    return prompts, _reference_cache[path]


def _run(path: str, prompts, **engine_options):
    llm = LLM(path, block_size=16, **engine_options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_greedy_matches_transformers(checkpoints, preset):
    prompts, expected = _reference(checkpoints[preset])
    _, got = _run(checkpoints[preset], prompts)
    assert got == expected


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_greedy_matches_under_preemption(checkpoints, preset):
    prompts, expected = _reference(checkpoints[preset])
    # 24 blocks hold the longest request (21 blocks) but not the batch: the scheduler must preempt.
    llm, got = _run(checkpoints[preset], prompts, num_kv_blocks=24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.block_pool.num_free_blocks == 24


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_chunked_prefill_gives_same_tokens(checkpoints, preset):
    prompts, expected = _reference(checkpoints[preset])
    llm, got = _run(checkpoints[preset], prompts, max_num_batched_tokens=32, max_num_seqs=16)
    assert got == expected


def test_prefix_caching_off_gives_same_tokens(checkpoints):
    prompts, expected = _reference(checkpoints["tiny-llama"])
    _, got = _run(checkpoints["tiny-llama"], prompts, enable_prefix_caching=False)
    assert got == expected


def test_mistral_config_matches_transformers(checkpoints, tmp_path):
    """Mistral is the Llama block under another name, with a sliding window in its config."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(checkpoints["tiny-llama"], tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096, rope_scaling=None)
    cfg_path.write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert type(model).__name__ == "MistralForCausalLM"
    prompts = _prompts(cfg["vocab_size"])[:5]
    expected = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=MAX_NEW, do_sample=False)[0, len(p):].tolist() for p in prompts]
    _, got = _run(str(tmp_path / "m"), prompts)
    assert got == expected
