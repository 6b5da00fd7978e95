"""DeepSeek-V3 without transformers: its published config as `ModelArch` reads it and what is refused
by name, the latent cache's size, the weight-absorbed decode against the expanded attention,
tensor parallelism's split of the absorbed projections, and the multi-token-prediction layer
skipped as a checkpoint loads."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta, forward_context
from pdserve.engine.checkpoint import PRESETS, _config, make_checkpoint
from pdserve.engine.kernels.paged_attention import GatherWorkspace
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.latent_attention import LatentAttention
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, softmax_scale
from pdserve.engine.models.loader import checkpoint_tensors, load_model, random_weights
from pdserve.engine.parallel import ParallelState
from pdserve.errors import ModelLoadError, UnsupportedModelError

# deepseek-ai/DeepSeek-V3's config.json as published (the fields ModelArch reads; FP8 weights).
HUB = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
       "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
       "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
       "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
       "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
       "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
       "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
       "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
       "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096, "type": "yarn"},
       "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
       "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [128, 128]}}


def test_the_published_config():
    arch = ModelArch.from_dict(HUB)
    assert arch.family == "deepseek_v3" and arch.is_mla and arch.is_moe
    assert (arch.kv_lora_rank, arch.q_lora_rank, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim) == \
        (512, 1536, 128, 64, 128)
    assert arch.latent_dim == 576 and arch.head_dim == 192 and arch.rope_interleave
    assert arch.dense_layers == (0, 1, 2) and arch.is_sparse_layer(3) and not arch.is_sparse_layer(2)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.n_group, arch.topk_group) == (256, 8, 8, 4)
    assert (arch.num_shared_experts, arch.routed_scaling_factor, arch.norm_topk_prob) == (1, 2.5, True)
    assert arch.quantization is not None and arch.dtype == torch.bfloat16
    # Softmax scale: 192 ** -0.5 times yarn's mscale(40, mscale_all_dim=1) squared.
    assert softmax_scale(arch) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    # A latent cache block: 576 values a token a layer, against 2 x 8 x 128 for GQA with 8 KV heads of 128.
    latent = KVCache.bytes_per_block_for(61, 1, 1, arch.latent_dim, torch.bfloat16, is_latent=True)
    assert latent == 61 * 576 * 2 and KVCache.bytes_per_block_for(61, 1, 8, 128, torch.bfloat16) == 61 * 2048 * 2


@pytest.mark.parametrize("change, error, words", [
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, UnsupportedModelError, "topk_method='greedy'"),
    ({"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq 2"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ({"n_group": 3}, ModelLoadError, "n_group 3"),
    ({"kv_lora_rank": None}, ModelLoadError, "kv_lora_rank"),
    ({"qk_rope_head_dim": 63}, ModelLoadError, "qk_rope_head_dim must be even"),
])
def test_what_it_does_not_implement_is_refused_by_name(change, error, words):
    with pytest.raises(error, match=words):
        ModelArch.from_dict({**HUB, **change})


def test_an_unknown_rope_type_is_refused_by_name():
    cfg = _config(PRESETS["tiny-deepseek-v3"], 512, 1, 2)
    arch = ModelArch.from_dict({**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'dynamic' is not supported"):
        DeepseekV3ForCausalLM(arch, 64)


def test_q_lora_rank_null_gives_one_q_projection():
    arch = ModelArch.from_dict({**_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2), "q_lora_rank": None})
    names = {name for name, _, _ in checkpoint_tensors(arch)}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.q_a_proj.weight" not in names
    model = DeepseekV3ForCausalLM(arch, 64)
    model.load_weights(random_weights(arch, torch.float32, "cpu"))  # every tensor placed, none missing
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 24, 64)


def test_absorbed_decode_equals_the_expanded_attention():
    """One sequence's last token by the decode path (W_UK folded into q, W_UV after) and by the
    prefill path (the context's latents expanded per head), over the same cached latents."""
    g = torch.Generator().manual_seed(0)
    heads, rank, nope, rope, v, bs, n = 4, 32, 16, 8, 16, 4, 23
    kv_b = torch.nn.Linear(rank, heads * (nope + v), bias=False)
    kv_b.weight.data = torch.randn(heads * (nope + v), rank, generator=g) / rank ** 0.5
    attn = LatentAttention(0, heads, rank, nope, rope, v, scale=0.3)
    attn.absorb(kv_b.weight.data)
    cache = KVCache(1, 16, bs, 1, rank + rope, is_latent=True)
    q = torch.randn(n, heads, nope + rope, generator=g)
    latent = torch.randn(n, rank + rope, generator=g)
    table = torch.tensor([5, 2, 9, 7, 11, 3])  # scattered blocks
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])

    def run(meta, q_rows, latent_rows):
        with forward_context(meta, cache, GatherWorkspace()):
            return attn(q_rows, latent_rows, kv_b)

    expanded = run(AttentionMetadata(slots, 0, None, None, [PrefillChunkMeta(0, n, n, table)]), q, latent)
    assert torch.equal(cache.layer(0).reshape(-1, rank + rope)[slots], latent)  # the cache holds the latents
    decoded = run(AttentionMetadata(slots[-1:], 1, table[None, :], torch.tensor([n]), []), q[-1:], latent[-1:])
    torch.testing.assert_close(decoded, expanded[-1:], rtol=1e-5, atol=1e-5)
    # And against attention written out from the formula, with K and V expanded by hand.
    kv = (latent[:, :rank] @ kv_b.weight.T).view(n, heads, nope + v)
    k = torch.cat((kv[..., :nope], latent[:, None, rank:].expand(n, heads, rope)), dim=-1)
    probs = F.softmax(torch.einsum("hd,nhd->hn", q[-1], k) * 0.3, dim=-1)
    reference = torch.einsum("hn,nhv->hv", probs, kv[..., nope:]).reshape(1, -1)
    torch.testing.assert_close(decoded, reference, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_ranks_split_the_absorbed_heads_and_share_the_latent():
    arch = ModelArch.from_dict(_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2))

    def shard(rank: int, size: int) -> DeepseekV3ForCausalLM:
        model = DeepseekV3ForCausalLM(arch, 64, ParallelState(rank, size))
        model.load_weights(random_weights(arch, torch.float32, "cpu", seed=3))
        model.finalize()
        return model

    whole, ranks = shard(0, 1), [shard(0, 2), shard(1, 2)]
    for i in range(arch.num_layers):
        one, parts = whole.model.layers[i].self_attn, [r.model.layers[i].self_attn for r in ranks]
        assert [p.attn.num_heads for p in parts] == [2, 2] and one.attn.num_heads == 4
        assert torch.equal(torch.cat([p.attn.w_uk for p in parts]), one.attn.w_uk)
        assert torch.equal(torch.cat([p.attn.w_uv for p in parts]), one.attn.w_uv)
        for p in parts:  # the latent's projection and norm, whole on each rank
            assert torch.equal(p.kv_a_proj_with_mqa.weight, one.kv_a_proj_with_mqa.weight)
            assert torch.equal(p.kv_a_layernorm.weight, one.kv_a_layernorm.weight)


def test_the_multi_token_prediction_layer_is_skipped(tmp_path):
    """A checkpoint with `num_nextn_predict_layers: 1` ships layer N (its MTP module) past the
    model's N layers: loading skips its tensors (the causal LM never runs it)."""
    path = make_checkpoint("tiny-deepseek-v3", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    tensors = load_file(path / "model.safetensors")
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
           "model.layers.2.self_attn.q_a_proj.weight": torch.randn(48, 64),
           "model.layers.2.shared_head.head.weight": torch.randn(512, 64)}
    save_file({**tensors, **mtp}, path / "model.safetensors")
    model, arch = load_model(path)
    assert arch.num_layers == 2 and len(model.model.layers) == 2
    assert model.map_weight_name("model.layers.2.eh_proj.weight") is None
    assert model.map_weight_name("model.layers.1.self_attn.q_a_proj.weight") is not None


def test_the_router_bias_stays_fp32_and_a_missing_one_is_named(tmp_path):
    """transformers keeps e_score_correction_bias in fp32 under a bf16 model: it settles close choices."""
    path = make_checkpoint("tiny-deepseek-v3", tmp_path)
    tensors = load_file(path / "model.safetensors")
    model, _ = load_model(path, dtype=torch.bfloat16)
    bias = model.model.layers[1].mlp.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 tensors.*e_score_correction_bias"):
        load_model(path)


@pytest.mark.parametrize("change, words", [({"intermediate_size": 161}, "dense layers' intermediate size 161"),
                                           ({"moe_intermediate_size": 47}, "expert intermediate size 47")])
def test_a_degree_that_does_not_divide_the_mlps_is_named(change, words):
    arch = ModelArch.from_dict({**_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2), **change})
    with pytest.raises(UnsupportedModelError, match=f"tensor_parallel_size 2 .*{words}"):
        DeepseekV3ForCausalLM(arch, 64, ParallelState(0, 2, expert_parallel="dense" in words))
