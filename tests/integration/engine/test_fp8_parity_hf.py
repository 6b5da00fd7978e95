"""A block-wise FP8 checkpoint against transformers: on a CPU, transformers dequantizes FP8 weights
at load (FineGrainedFP8, which needs accelerate), as pdserve does, so both hold the same numbers and
greedy output is token-identical.

The block here divides every dimension: transformers 5's CPU dequantization refuses ragged edge blocks
("Weight shape (128, 64) not divisible by scale grid (3, 2)"), which DeepSeek-V3's own checkpoint has
(kv_a_proj_with_mqa: 576 rows, 4.5 blocks of 128); pdserve's are checked against the definition in
tests/unit/engine/test_fp8_checkpoints.py."""

import random

import pytest
import torch

from pdserve.engine.checkpoint import make_checkpoint
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.fakes.fp8_checkpoint import write_fp8_checkpoint
from tests.harness.hf_checkpoints import transformers_greedy

pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")

PROMPT_LENS = [1, 17, 100]  # long prompts and preemption: test_parity_hf.py
MAX_NEW = 12


# DeepSeek-V3 (its official release is FP8): MLA's projections and the experts quantized; 8 divides
# every dimension of the tiny preset (q_b_proj 96 x 48, kv_a_proj_with_mqa 40 x 64, ...).
@pytest.mark.parametrize("preset, block", [("tiny-qwen3", (32, 32)), ("tiny-deepseek-v3", (8, 8))])
def test_fp8_greedy_matches_transformers(tmp_path, preset, block):
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(preset, tmp_path / "src", seed=0)
    dequantized = write_fp8_checkpoint(src, tmp_path / "fp8", block=block)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    state = model.state_dict()
    # dequantized alike (transformers 5 holds a layer's experts as one fused tensor: not compared by name)
    compared = {name: t for name, t in dequantized.items() if ".experts." not in name}
    assert compared and all(torch.equal(state[name], t) for name, t in compared.items())

    rng = random.Random(7)
    prompts = [[rng.randrange(5, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    expected = transformers_greedy(model, prompts, MAX_NEW)
    got = LLM(str(tmp_path / "fp8"), block_size=16).generate(prompts, SamplingParams(max_tokens=MAX_NEW,
                                                                                     temperature=0.0))
    assert [o.token_ids for o in got] == expected
