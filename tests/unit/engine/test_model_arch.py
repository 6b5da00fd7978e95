"""What `ModelArch` reads from the configs of the families added in #44 (Qwen3, Qwen3-MoE, Phi-3), and
that pdserve's own presets of them hold exactly the tensors their configs imply."""

from __future__ import annotations

import pytest

from pdserve.engine.checkpoint import PRESETS, _config
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.loader import checkpoint_tensors
from pdserve.errors import ModelLoadError, UnsupportedModelError

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 160,
             "moe_intermediate_size": 48, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "num_experts": 8,
             "num_experts_per_tok": 2}


def test_qwen3_has_qk_norm_no_bias_and_its_own_head_dim():
    arch = ModelArch.from_dict({**QWEN3_MOE, "model_type": "qwen3"})
    assert (arch.qk_norm, arch.qkv_bias, arch.head_dim, arch.is_moe) == (True, False, 32, False)


@pytest.mark.parametrize("fields, dense", [
    ({}, ()),
    ({"mlp_only_layers": [0, 5]}, (0, 5)),
    ({"decoder_sparse_step": 2}, (0, 2, 4)),  # transformers: sparse where (i + 1) % step == 0
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (0, 1, 2, 4)),
])
def test_qwen3_moe_dense_layers(fields, dense):
    arch = ModelArch.from_dict({**QWEN3_MOE, **fields})
    assert arch.dense_layers == dense
    assert [i for i in range(6) if arch.is_sparse_layer(i)] == [i for i in range(6) if i not in dense]


def test_qwen3_moe_reads_either_expert_count_and_its_routing_rule():
    hub = ModelArch.from_dict(QWEN3_MOE)
    written = ModelArch.from_dict({**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"},
                                   "num_local_experts": 8, "norm_topk_prob": True})
    assert (hub.num_experts, hub.norm_topk_prob) == (8, False)  # transformers' default: no renormalising
    assert (written.num_experts, written.norm_topk_prob) == (8, True)
    assert hub.moe_intermediate_size == 48


def test_qwen3_moe_without_its_expert_fields_says_which():
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        ModelArch.from_dict({k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"})


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_preset_tensors_follow_the_config(preset):
    arch = ModelArch.from_dict(_config(PRESETS[preset], 512, 1, 2))
    names = {name for name, _, _ in checkpoint_tensors(arch)}
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" not in names
    if arch.is_moe:  # layer 1 is dense, the others hold experts under Qwen3-MoE's names
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
        assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names


def test_phi3_preset_stores_fused_projections():
    arch = ModelArch.from_dict(_config(PRESETS["tiny-phi3"], 512, 1, 2))
    shapes = {name: shape for name, shape, _ in checkpoint_tensors(arch)}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 + 2) * 16, 64)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 160, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes


def test_phi3_longrope_reads_the_pretraining_length_beside_rope_scaling():
    cfg = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 256,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    assert ModelArch.from_dict(cfg).rope_scaling["original_max_position_embeddings"] == 256


def test_a_partial_rotary_factor_is_refused_by_name():
    cfg = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "partial_rotary_factor": 0.75}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        ModelArch.from_dict(cfg)
