"""Deterministic random checkpoints in Hugging Face format, for tests, demos and benchmarks.

`make_checkpoint(preset, out_dir, seed)` writes config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with a chat template). The tokenizer is a byte-level BPE trained here on a
generated corpus: nothing is downloaded. `transformers` loads the result with its Auto classes.

Random weights give near-uniform next-token distributions, where float rounding flips greedy
choices between implementations. The presets therefore scale the embeddings and LM head up so
the top token usually wins by a wide margin ("peaked" distributions); the layers keep enough
weight to make the output depend on the whole context.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# torch and safetensors are imported where weights are made, so the CLI's `--help` stays fast.

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which were are be "
    "had one all their has new more time when would about there can other into only after first "
    "over also may where these many through most such some people before between world during "
    "city state under school system group water light house river north south east west power "
    "music model token cache block serve prefill decode request stream router engine batch queue "
    "paris london tokyo cairo lima oslo rome delhi seoul nairobi quick brown fox jumps lazy dog "
    "red green blue yellow black white small large early late high low hello world question answer"
).split()


@dataclass(frozen=True)
class Preset:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None  # None: the tokenizer's size
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    tokenizer_vocab_size: int = 512
    peaked: bool = True
    head_dim: int | None = None  # None: hidden_size // num_heads
    moe_intermediate_size: int = 0  # Qwen3-MoE's experts
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE's mlp_only_layers
    sliding_window: int | None = None  # Gemma 3's window, for the layers `layer_types` says slide
    layer_types: tuple[str, ...] = ()
    # DeepSeek-V3's attention: (kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    mla: tuple[int, int | None, int, int, int] | None = None


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("llama", 64, 160, 2, 4, 2, None, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "tiny-qwen2": Preset("qwen2", 64, 160, 2, 4, 2, None, rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny-mixtral": Preset("mixtral", 64, 96, 2, 4, 2, None, num_experts=4, num_experts_per_tok=2),
    # Qwen3: q/k norms and a head_dim that is not hidden_size // heads; its MoE with one dense layer.
    "tiny-qwen3": Preset("qwen3", 64, 160, 2, 4, 2, None, rope_theta=1000000.0, head_dim=32),
    # Phi-3: fused q/k/v and gate/up tensors, LongRoPE (short factors: within its pretraining length).
    "tiny-phi3": Preset("phi3", 64, 160, 2, 4, 2, None,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 16 for i in range(8)],
                                      "long_factor": [1.0 + i / 2 for i in range(8)],
                                      "original_max_position_embeddings": 2048}),
    "tiny-qwen3-moe": Preset("qwen3_moe", 64, 160, 3, 4, 2, None, rope_theta=1000000.0, head_dim=32,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, dense_layers=(1,)),
    # Gemma 3: sliding layers (a 40-token window) around a global one, q/k norms, gelu, four norms a layer.
    "tiny-gemma3": Preset("gemma3_text", 64, 160, 3, 4, 2, None, head_dim=16, sliding_window=40,
                          layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    # DeepSeek-V3: MLA (a 32-wide latent, an 8-wide rotary key: 40 cached values a token a layer),
    # yarn rope, one dense layer then DeepSeekMoE (8 experts in 4 groups, a shared expert).
    "tiny-deepseek-v3": Preset("deepseek_v3", 64, 160, 2, 4, 4, None, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=48, dense_layers=(0,), mla=(32, 48, 16, 8, 16),
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                             "original_max_position_embeddings": 512}),
    # The ~56M-parameter Llama shape the engine benchmarks use.
    "bench-llama-56m": Preset("llama", 512, 1408, 8, 8, 4, 32000, max_position_embeddings=4096,
                              tokenizer_vocab_size=1024, peaked=False),
    # The same shape with the vocabulary cut to its tokenizer's, so every sampled token has text:
    # what the serving benchmarks stream (the bench client times text chunks, as vLLM's does).
    "serve-llama-40m": Preset("llama", 512, 1408, 8, 8, 4, None, max_position_embeddings=4096,
                              tokenizer_vocab_size=1024, peaked=False),
    # The other families at bench-llama-56m's dimensions, each with its own parts (benchmarks/
    # model_families.py): Qwen3's q/k norms; Qwen3-MoE's 8 experts (top 2) of 176 in every layer;
    # Phi-3's fused projections and LongRoPE (short factors: within its pretraining length); Gemma 3's
    # 5:1 sliding (512-token window) and global layers, gelu and four norms a layer; DeepSeek-V3's below.
    "bench-qwen3-56m": Preset("qwen3", 512, 1408, 8, 8, 4, 32000, max_position_embeddings=4096,
                              rope_theta=1000000.0, head_dim=64, tokenizer_vocab_size=1024, peaked=False),
    "bench-qwen3-moe-56m": Preset("qwen3_moe", 512, 1408, 8, 8, 4, 32000, max_position_embeddings=4096,
                                  rope_theta=1000000.0, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=176, tokenizer_vocab_size=1024, peaked=False),
    "bench-phi3-56m": Preset("phi3", 512, 1408, 8, 8, 4, 32000, max_position_embeddings=4096,
                             rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(32)],
                                           "long_factor": [1.0 + i / 8 for i in range(32)],
                                           "original_max_position_embeddings": 4096},
                             tokenizer_vocab_size=1024, peaked=False),
    "bench-gemma3-56m": Preset("gemma3_text", 512, 1408, 8, 8, 4, 32000, max_position_embeddings=4096,
                               head_dim=64, sliding_window=512, layer_types=("sliding_attention",) * 5
                               + ("full_attention",) + ("sliding_attention",) * 2,
                               tokenizer_vocab_size=1024, peaked=False),
    # DeepSeek-V3 at the same width, layers and heads: MLA (a 192-wide latent and a 32-wide rotary
    # key: 224 cached values a token a layer, against Llama's 512; q through a 192-wide rank), one
    # dense layer, then DeepSeekMoE (8 routed experts of 152 in 4 groups, top 2, and a shared one:
    # 9 x 152 against the dense 1408), yarn rope as the tiny preset's.
    "bench-deepseek-v3-56m": Preset("deepseek_v3", 512, 1408, 8, 8, 8, 32000, max_position_embeddings=4096,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=152,
                                    dense_layers=(0,), mla=(192, 192, 64, 32, 64),
                                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024},
                                    tokenizer_vocab_size=1024, peaked=False),
}


def _corpus(num_lines: int = 4000) -> list[str]:
    rng = random.Random(1234)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice(".?!,")
            for _ in range(num_lines)]


def build_tokenizer(vocab_size: int, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer that prepends BOS, trained deterministically on a fixed corpus
    (or on `corpus`: a vocabulary larger than the fixed one's words allow)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or _corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def _config(p: Preset, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    cfg = {
        "architectures": [arch[p.model_type]],
        "model_type": p.model_type,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim or p.hidden_size // p.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": p.rope_theta,
        "rope_scaling": p.rope_scaling,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if p.model_type.startswith("qwen"):
        cfg.update(use_sliding_window=False, sliding_window=None)
    if p.model_type == "mixtral":
        cfg.update(num_local_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok)
    if p.model_type == "phi3":
        cfg.update(original_max_position_embeddings=p.rope_scaling["original_max_position_embeddings"],
                   pad_token_id=eos_id)
    if p.model_type == "gemma3_text":
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg["head_dim"],
                   sliding_window=p.sliding_window, layer_types=list(p.layer_types),
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
        del cfg["hidden_act"], cfg["rope_theta"], cfg["rope_scaling"]
    if p.model_type == "qwen3_moe":
        cfg.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok, norm_topk_prob=True,
                   moe_intermediate_size=p.moe_intermediate_size, decoder_sparse_step=1,
                   mlp_only_layers=list(p.dense_layers))
    if p.model_type == "deepseek_v3":
        kv_lora, q_lora, nope, rope, v = p.mla
        cfg.update(kv_lora_rank=kv_lora, q_lora_rank=q_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                   v_head_dim=v, head_dim=rope, rope_interleave=True, n_routed_experts=p.num_experts,
                   num_experts_per_tok=p.num_experts_per_tok, moe_intermediate_size=p.moe_intermediate_size,
                   n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   first_k_dense_replace=len(p.dense_layers), scoring_func="sigmoid", topk_method="noaux_tc",
                   num_nextn_predict_layers=0, attention_bias=False)
    return cfg


def _weights(p: Preset, vocab_size: int, seed: int) -> dict:
    import torch

    from pdserve.engine.models.arch import ModelArch
    from pdserve.engine.models.loader import checkpoint_tensors

    g = torch.Generator().manual_seed(seed)
    h = p.hidden_size
    # Peaked presets: large embedding/head scale so top tokens win by wide margins (see module doc).
    emb_std, head_std, layer_std = (1.0, 8.0 / h ** 0.5, 1.5 / h ** 0.5) if p.peaked else (0.02, 0.02, 0.02)
    std = {"embedding": head_std if p.tie_word_embeddings else emb_std, "lm_head": head_std, "linear": layer_std,
           "bias": 0.1, "router": 1.0 / h ** 0.5, "norm": 0.1}
    arch = ModelArch.from_dict(_config(p, vocab_size, 0, 0))
    return {name: (torch.randn(*shape, generator=g) * std[kind] + (kind == "norm")).contiguous()
            for name, shape, kind in checkpoint_tensors(arch)}


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the preset's checkpoint to out_dir (created; files in it are overwritten)."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(p.tokenizer_vocab_size)
    vocab_size = p.vocab_size or tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS,
        "add_bos_token": True, "model_max_length": p.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2))
    (out / "config.json").write_text(json.dumps(_config(p, vocab_size, bos_id, eos_id), indent=2))
    save_file(_weights(p, vocab_size, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return Path(root)


def default_model(preset: str = "tiny-llama", seed: int = 0) -> Path:
    """The preset's checkpoint in the cache directory, generated on first use."""
    target = cache_dir() / "models" / f"{preset}-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent first use never sees a half-written one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        make_checkpoint(preset, tmp, seed)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
