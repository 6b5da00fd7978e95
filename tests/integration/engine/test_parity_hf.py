"""The engine against transformers, its reference: greedy output is token-identical to
`generate` whatever the batching does, prompt logprobs equal its log-softmax, transformers loads
the checkpoints pdserve generates (and its sharded save of one gives the same tokens), and the
RoPE scalings give its inverse frequencies. (Loading a transformers model takes seconds: the
unit tier checks the engine against itself instead.)"""

import math
import random
import shutil

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.models.layers import rope_inv_freq
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


def test_prompt_logprobs_match_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM

    prompt = list(range(20, 20 + 45))
    llm = LLM(tiny_llama, max_num_batched_tokens=16, max_num_seqs=4)  # chunked: scores span steps
    llm.generate([prompt], SamplingParams(max_tokens=1))  # warm the prefix cache: it must be bypassed
    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == prompt[i]
        assert math.isclose(lp.logprob, ref[i - 1, prompt[i]].item(), abs_tol=1e-4)
        assert [t for t, _ in lp.top] == ref[i - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_transformers_loads_the_generated_checkpoint(checkpoints, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoints[preset])
    tok = AutoTokenizer.from_pretrained(checkpoints[preset])
    assert model.config.model_type == preset.split("-")[1]
    ours = LLM(checkpoints[preset]).tokenizer
    text = "hello world, the quick brown fox jumps"
    assert tok(text).input_ids == ours.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src = checkpoints["tiny-qwen2"]
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    greedy = SamplingParams(max_tokens=10, temperature=0)
    assert LLM(str(tmp_path)).generate(["paris"], greedy)[0].token_ids == \
        LLM(src).generate(["paris"], greedy)[0].token_ids


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2},
])
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096,
                      rope_scaling=dict(scaling), rope_theta=10000.0)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    inv_freq, factor = rope_inv_freq(64, 10000.0, scaling, 4096)
    assert torch.allclose(inv_freq, ref_inv_freq.float(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor)
