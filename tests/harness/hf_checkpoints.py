"""Tiny checkpoints of each supported family written by `transformers` itself: its config class,
its model class, `save_pretrained` in several shards. The engine must load what `transformers`
writes, so these (not pdserve's own `make-model` writer) are the parity tests' inputs.

transformers' initialisation (std 0.02) gives near-uniform next-token distributions, where float
rounding flips greedy choices between any two implementations; the weights are redrawn at
checkpoint.py's "peaked" scales first (embedding 1, LM head 8/sqrt(hidden), linears
1.5/sqrt(fan-in), norms 1 +- 0.1), so the top token wins by a wide margin and greedy tokens
compare exactly. The tokenizer is the tiny presets' (copied from a `make_checkpoint` directory).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# family -> (config class, model class, config fields beyond the shared ones)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "intermediate_size": 160}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 32, "intermediate_size": 160, "moe_intermediate_size": 48, "num_experts": 4,
                   "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": [1]}),
    # LongRoPE within its pretraining length (the short factors); test_model_families crosses it.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"intermediate_size": 160, "pad_token_id": 0, "original_max_position_embeddings": 2048,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(8)],
                               "long_factor": [1.0 + i / 2 for i in range(8)]}}),
    # Gemma 3: sliding layers around a global one, a 40-token window (not a whole number of
    # 16-token blocks), linear rope scaling on the global layer only, its own
    # attention scale, soft-capped logits.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 160, "sliding_window": 40,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "query_pre_attn_scalar": 24, "final_logit_softcapping": 50.0,
                     "pad_token_id": 0,
                     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # DeepSeek-V3: MLA (a 32-wide latent and an 8-wide rotary key: 40 values a token a layer),
    # DeepSeek's yarn rope with mscale (the softmax scaled too), interleaved rotary rows, one
    # dense layer then DeepSeekMoE (8 experts in 4 groups, top-2 of the best 2 groups, a shared
    # expert). num_key_value_heads = heads: transformers repeats its expanded K/V otherwise.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_key_value_heads": 4, "intermediate_size": 160, "moe_intermediate_size": 48,
                     "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                     "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "num_mtp_layers": 0,
                     "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "rope_theta": 10_000.0}}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _peaked_(model: torch.nn.Module, hidden: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by 1 + weight, and its embedding (tied to the LM head) by sqrt(hidden):
    # the norms after attention and after the MLP get a gain of ~16 so each layer's output is not
    # drowned by the scaled embedding (else the next token is the current one, whatever came before).
    gemma = model.config.model_type.startswith("gemma")
    for name, p in sorted(model.named_parameters()):
        if gemma and name.endswith("norm.weight"):
            gain = 16.0 if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")) else 1.0
            value = gain - 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif "embed_tokens" in name:
            value = torch.randn(p.shape, generator=g)
        elif name.startswith("lm_head"):
            value = torch.randn(p.shape, generator=g) * 8.0 / hidden ** 0.5
        elif name.endswith("bias"):
            value = 0.1 * torch.randn(p.shape, generator=g)
        else:  # [..., out, in]: linears, routers and stacked experts
            value = torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5
        p.data.copy_(value)
    for name, b in model.named_buffers():  # DeepSeek-V3's router bias: init writes zeros, which test nothing
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def write_checkpoint(family: str, out_dir: Path, tokenizer_dir: str | Path, seed: int = 0,
                     num_layers: int = 2, **config_fields) -> Path:
    """`family`'s tiny model, random at peaked scales, saved by `transformers` in several shards;
    `config_fields` override the family's config."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    src = Path(tokenizer_dir)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size()
    hidden = 64
    shared = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, config_cls)(**{**shared, **extra, **config_fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _peaked_(model, hidden, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="100KB")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out_dir / name)
    return out_dir


def transformers_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A transformers model's greedy continuation of each prompt, one at a time (no padding)."""
    outs = []
    for ids in prompt_ids:
        t = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, len(ids):].tolist())
    return outs
