"""Gemma 3's config.json as `ModelArch` reads it: both model types, hub configs that omit
Gemma3TextConfig's defaults, both rope styles, and what is refused by name."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_groups import layer_groups
from pdserve.engine.models.arch import ModelArch
from pdserve.errors import UnsupportedModelError

# The text half of google/gemma-3-4b-it's config.json as published (older transformers: defaults omitted).
HUB_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024},
          "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"}}


def test_a_conditional_generation_config_reads_its_text_model_with_the_defaults():
    arch = ModelArch.from_dict(HUB_4B)
    assert arch.family == "gemma3" and arch.hidden_size == 2560 and arch.num_layers == 34
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (8, 4, 256, 262_208)
    assert arch.query_pre_attn_scalar == 256 and arch.hidden_act == "gelu_pytorch_tanh" and arch.tie_word_embeddings
    assert arch.eos_token_ids == (1, 106)
    assert arch.rope_theta == 1_000_000.0 and arch.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert arch.local_rope_theta == 10_000.0 and arch.local_rope_scaling is None
    # Every sixth layer is global; the sliding window does not bound the context.
    assert [i for i, w in enumerate(arch.layer_windows) if w is None] == [5, 11, 17, 23, 29]
    assert set(arch.layer_windows) == {None, 1024} and arch.sliding_window is None
    assert arch.context_len == 131_072
    groups = layer_groups(arch.num_layers, arch.layer_windows)
    assert groups[0].window is None and len(groups[0].layers) == 5
    assert all(len(g.layers) <= 5 and g.window == 1024 for g in groups[1:]) and len(groups) == 7


def test_transformers_5_nested_rope_parameters_per_layer_type():
    cfg = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 40,
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
           "final_logit_softcapping": 30.0}
    arch = ModelArch.from_dict(cfg)
    assert arch.layer_windows == (40, None) and arch.rope_theta == 1e6 and arch.local_rope_theta == 1e4
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0} and arch.final_logit_softcapping == 30.0
    old_style = {**cfg, "rope_parameters": None, "rope_theta": 2e6, "rope_local_base_freq": 5e3}
    arch = ModelArch.from_dict(old_style)
    assert arch.rope_theta == 2e6 and arch.local_rope_theta == 5e3 and arch.rope_scaling is None


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)])
def test_what_gemma3_does_not_implement_is_refused_by_name(field, value):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelArch.from_dict({**HUB_4B, "text_config": {**HUB_4B["text_config"], field: value}})
