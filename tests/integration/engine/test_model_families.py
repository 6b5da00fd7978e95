"""The families beyond Llama/Mixtral (issue #44), each from a checkpoint `transformers` wrote in
several shards: `pdserve generate --json` gives transformers' greedy tokens with a cache small
enough to preempt; chunked prefill equals unchunked; two ranks (tensor or expert parallel)
equal one."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.sampling_params import SamplingParams
from tests.harness.hf_checkpoints import FAMILIES, transformers_greedy, write_checkpoint
from tests.integration.engine.test_tensor_parallel import generate, same_tokens_close_logprobs

MAX_NEW = 16
NUM_KV_BLOCKS = 24  # 16-token blocks: holds the longest request, not the whole batch


def _text_prompts() -> list[str]:
    """8 prompts of 1 to ~300 tokens."""
    rng = random.Random(3)
    words = "the model token cache block serve prefill decode paris london quick brown fox".split()
    return [" ".join(rng.choice(words) for _ in range(n)) for n in (0, 1, 7, 15, 16, 40, 120, 210)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, checkpoints, tmp_path_factory) -> tuple[str, str]:
    family = request.param
    path = write_checkpoint(family, tmp_path_factory.mktemp(family), checkpoints["tiny-llama"])
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded, as real checkpoints are
    return family, str(path)


_reference: dict[str, list[list[int]]] = {}


def _transformers_greedy(path: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    if path not in _reference:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _reference[path] = transformers_greedy(model, prompt_ids, MAX_NEW)
    return _reference[path]


def _prompt_ids(path: str) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    return [tok.encode(p).ids for p in _text_prompts()]


def _small_cache(path: str) -> dict:
    """Engine settings whose cache holds the longest request but not the batch. A model of several
    layer groups (Gemma 3's sliding and global layers) gives its sliding layers' blocks back as its
    requests move on, so its cache fills only while prompts are prefilled in chunks beside decodes."""
    if ModelArch.from_dir(path).layer_windows:
        return {"num_kv_blocks": 36, "max_num_batched_tokens": 32, "max_num_seqs": 8}
    return {"num_kv_blocks": NUM_KV_BLOCKS}


def test_generate_json_matches_transformers_with_preemption(family_checkpoint, capsys):
    from pdserve.cli import main

    family, path = family_checkpoint
    assert ModelArch.from_dir(path).model_type == family
    ids = _prompt_ids(path)
    assert min(map(len, ids)) == 1 and 250 <= max(map(len, ids)) <= 300
    cache = _small_cache(path)
    args = ["generate", "--model", path, "--json", "--max-tokens", str(MAX_NEW)]
    for name, value in cache.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    for p in _text_prompts():
        args += ["--prompt", p]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records] == _transformers_greedy(path, ids)
    # The same batch on the same cache preempts (the CLI does not say so; the engine does).
    llm = LLM(path, **cache)
    llm.generate(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free_blocks == cache["num_kv_blocks"]


def test_chunked_prefill_equals_unchunked(family_checkpoint):
    _, path = family_checkpoint
    ids = _prompt_ids(path)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    whole = [o.token_ids for o in LLM(path).generate(ids, params)]
    chunked = [o.token_ids for o in LLM(path, max_num_batched_tokens=32, max_num_seqs=4).generate(ids, params)]
    assert chunked == whole == _transformers_greedy(path, ids)


def test_two_ranks_equal_one(family_checkpoint):
    family, path = family_checkpoint
    one = generate(path)
    same_tokens_close_logprobs(one, generate(path, tensor_parallel_size=2))
    if ModelArch.from_dir(path).is_moe:
        same_tokens_close_logprobs(one, generate(path, tensor_parallel_size=2, enable_expert_parallel=True))


def test_phi3_longrope_short_and_long_factors(checkpoints, tmp_path):
    """LongRoPE past a 64-token pretraining length: an engine that serves longer sequences uses
    the long factors (transformers too, once a sequence passes 64 tokens), one that does not
    uses the short ones (transformers too, within 64 tokens)."""
    path = str(write_checkpoint("phi3", tmp_path / "phi3-long", checkpoints["tiny-llama"],
                                original_max_position_embeddings=64))
    ids = _prompt_ids(path)
    expected = _transformers_greedy(path, ids)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    long_ids = [i for i, p in enumerate(ids) if len(p) > 64]
    short_ids = [i for i, p in enumerate(ids) if len(p) + MAX_NEW <= 64]
    assert len(long_ids) >= 2 and len(short_ids) >= 3
    served_long = LLM(path).generate([ids[i] for i in long_ids], params)
    assert [o.token_ids for o in served_long] == [expected[i] for i in long_ids]
    served_short = LLM(path, max_model_len=64).generate([ids[i] for i in short_ids], params)
    assert [o.token_ids for o in served_short] == [expected[i] for i in short_ids]
