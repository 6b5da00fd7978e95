"""DeepSeek-V3's KV cache holds multi-head latent attention's compressed vectors and nothing else:
per token and layer, transformers' own cache entries (the normalised latent, the rotated shared
key), (kv_lora_rank + qk_rope_head_dim) values; the engine's token-for-token parity with
transformers (prefill on the expanded path, decode on the absorbed one), chunking, preemption and
two ranks are test_model_families.py's."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.blocks import gather_blocks
from tests.harness.hf_checkpoints import write_checkpoint

BLOCK = 8


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory) -> str:
    return str(write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), checkpoints["tiny-llama"]))


def test_the_cache_holds_transformers_latents_only(model):
    from transformers import AutoModelForCausalLM

    arch = ModelArch.from_dir(model)
    prompt = [1] + list(range(40, 76))  # 37 tokens: four full blocks and a partial one
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=32, block_size=BLOCK, num_threads=1,
                                    max_num_batched_tokens=16, max_num_seqs=4))  # prefilled in three chunks
    try:
        engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0), prefill_only=True)
        first = None
        while first is None or first.kv_block_ids is None:
            first = next(iter(engine.step()), first)
        cache = engine.kv_cache
        assert cache.is_latent
        assert cache.kv.shape == (arch.num_layers, 1, 32, BLOCK, 1, arch.kv_lora_rank + arch.qk_rope_head_dim)
        assert cache.bytes_per_token == arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 4
        # [layers, tokens, latent]: what the engine cached for the prompt, in token order.
        ours = gather_blocks(cache.kv, first.kv_block_ids).reshape(arch.num_layers, -1, arch.latent_dim)
        ours = ours[:, :len(prompt)]
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_cache = hf(torch.tensor([prompt]), use_cache=True).cache
    for layer, entry in enumerate(hf_cache.layers):  # keys: the normalised latent; values: rotated k_r
        theirs = torch.cat((entry.keys[0, 0], entry.values[0, 0]), dim=-1)
        torch.testing.assert_close(ours[layer], theirs, rtol=1e-4, atol=1e-4)  # fp32 summation order
