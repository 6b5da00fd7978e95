"""Gemma 3 beyond the family tests (test_model_families.py runs those for it): a sequence longer
than the sliding window holds at most the window's blocks in each sliding layer group and still
matches transformers; a prefix reused across the window gives the same tokens; the language model
of a Gemma3ForConditionalGeneration checkpoint (the 4B and larger models' form) loads, text only."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve.engine.kv_groups import first_needed_block
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.harness.hf_checkpoints import write_checkpoint
from tests.integration.engine.test_model_families import MAX_NEW, _prompt_ids, _transformers_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def gemma3(checkpoints, tmp_path_factory) -> str:
    return str(write_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma3"), checkpoints["tiny-llama"]))


def test_sliding_layers_hold_at_most_their_window_and_match_transformers(gemma3):
    ids = _prompt_ids(gemma3)
    expected = _transformers_greedy(gemma3, ids)
    long_ids = [i for i, p in enumerate(ids) if len(p) > 3 * 40]
    assert long_ids
    llm = LLM(gemma3, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.engine
    window = engine.arch.layer_windows[0]
    assert window == 40 and engine.kv_cache.kv.shape[0] == 1  # one layer slot: a block id is one layer's block
    kv = engine.kv_manager
    for i in long_ids:
        engine.add_request(f"r{i}", ids[i], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    outputs: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        for r in engine.scheduler.running:
            global_blocks, *sliding = kv.num_held_blocks(r.request_id)
            assert global_blocks == -(-r.num_tokens // BLOCK) or global_blocks == -(-r.num_computed_tokens // BLOCK)
            if r.num_computed_tokens >= len(r.prompt_token_ids):  # decoding: past the window by far
                first = first_needed_block(r.num_computed_tokens, window, BLOCK)
                assert all(s == len(kv.get_block_tables(r.request_id)[0]) - first for s in sliding)
                most_held = max(most_held, *sliding)
    assert 0 < most_held <= -(-(window - 1) // BLOCK) + 1
    assert [outputs[f"r{i}"] for i in long_ids] == [expected[i] for i in long_ids]
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_prefix_cached_across_the_window_gives_the_same_tokens(gemma3):
    ids = _prompt_ids(gemma3)
    expected = _transformers_greedy(gemma3, ids)
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    llm = LLM(gemma3, block_size=BLOCK)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    assert llm.generate([ids[longest]], params)[0].token_ids == expected[longest]
    again = llm.generate([ids[longest]], params)[0]
    # The blocks the sliding layers gave back stayed cached: the whole prompt but its last block hits.
    assert again.token_ids == expected[longest]
    assert again.num_cached_tokens == (len(ids[longest]) - 1) // BLOCK * BLOCK


def test_the_language_model_of_a_conditional_generation_checkpoint(checkpoints, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    from tests.harness.hf_checkpoints import TOKENIZER_FILES, _peaked_

    src = checkpoints["tiny-llama"]
    vocab = Tokenizer.from_file(f"{src}/tokenizer.json").get_vocab_size()
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=24, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _peaked_(model.model.language_model, 64, 0)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in TOKENIZER_FILES:
        shutil.copy(f"{src}/{name}", tmp_path / name)
    prompts = [[1, 5, 9, 33], list(range(40, 100))]  # the second longer than the window
    expected = []
    for p in prompts:
        t = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=8, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    served = LLM(str(tmp_path)).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.token_ids for o in served] == expected
