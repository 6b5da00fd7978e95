"""`ModelSpec`: what the roofline needs to know about a model, from pdserve's own architecture code.

In: a checkpoint directory (its config.json, read by `pdserve.engine.models.arch.ModelArch`), one
of the engine's generated presets (`serve-llama-40m`, ...), or one of the public configs below
(`llama-3.1-8b`, ...). Out: parameter counts (total, active per token, the experts' share), layers,
attention width, KV bytes per token and the bytes a weight takes.

Counted: every matrix a step multiplies by (attention projections, MLPs or experts, the LM head);
the input embedding is a gather and is not streamed. Not modelled: sliding windows (every layer is
charged its whole context), quantization scales, norms and biases (under 0.1% of the bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# Public Hugging Face config.json fields of a few models a plan is made for (the fields ModelArch
# reads; values as published in each repository's config.json).
PUBLIC_CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    # meta-llama/Llama-3.1-70B-Instruct
    "llama-3.1-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 active per token
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                      "max_position_embeddings": 40960, "torch_dtype": "bfloat16"},
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    dense_params: int  # matrices every token multiplies by (attention, dense MLPs, shared experts, LM head)
    num_moe_layers: int
    num_experts: int
    num_experts_per_tok: int
    expert_params: int  # one expert of one layer
    weight_bytes_per_param: float
    kv_bytes_per_token: int  # all layers, K and V (or MLA's latent)

    @property
    def num_params(self) -> int:
        return self.dense_params + self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def num_active_params(self) -> int:
        return self.dense_params + self.num_moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.weight_bytes_per_param

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step of `num_tokens` tokens streams: the dense matrices, and each MoE
        layer's experts that at least one token picks (uniform routing: E(1 - (1 - k/E)^T))."""
        if not self.num_moe_layers or num_tokens <= 0:
            return self.dense_params * self.weight_bytes_per_param + (
                self.num_moe_layers * self.num_experts_per_tok * self.expert_params * self.weight_bytes_per_param)
        share = 1.0 - (1.0 - self.num_experts_per_tok / self.num_experts) ** num_tokens
        experts = self.num_moe_layers * self.num_experts * share * self.expert_params
        return (self.dense_params + experts) * self.weight_bytes_per_param

    @property
    def flops_per_token(self) -> float:
        """Matrix FLOPs of one token (2 per multiply-add of each active weight)."""
        return 2.0 * self.num_active_params

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query token, context token) pair over all layers: QK^T and PV."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


def from_arch(arch, name: str, weight_bytes_per_param: float | None = None,
              kv_bytes_per_value: float | None = None) -> ModelSpec:
    """A `ModelSpec` from a `ModelArch`; bytes per weight and per KV value default to the model's dtype."""
    h, layers = arch.hidden_size, arch.num_layers
    dtype_bytes = arch.dtype_bytes
    if arch.is_mla:
        q_width = arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim)
        q = h * arch.q_lora_rank + arch.q_lora_rank * q_width if arch.q_lora_rank else h * q_width
        attn = (q + h * arch.latent_dim + arch.kv_lora_rank * arch.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim)
                + arch.num_heads * arch.v_head_dim * h)
        kv_values = arch.latent_dim
    else:
        attn = 2 * h * arch.num_heads * arch.head_dim + 2 * h * arch.num_kv_heads * arch.head_dim
        kv_values = 2 * arch.num_kv_heads * arch.head_dim
    moe_layers = sum(arch.is_sparse_layer(i) for i in range(layers))
    expert = 3 * h * (arch.moe_intermediate_size or arch.intermediate_size) if arch.is_moe else 0
    shared = arch.num_shared_experts * expert
    dense_mlps = (layers - moe_layers) * 3 * h * arch.intermediate_size
    router = moe_layers * h * arch.num_experts
    dense = layers * attn + dense_mlps + moe_layers * shared + router + arch.vocab_size * h  # LM head
    kv_bytes = kv_bytes_per_value if kv_bytes_per_value is not None else dtype_bytes
    return ModelSpec(name=name, num_layers=layers, hidden_size=h, num_heads=arch.num_heads, head_dim=arch.head_dim,
                     dense_params=dense, num_moe_layers=moe_layers, num_experts=arch.num_experts,
                     num_experts_per_tok=arch.num_experts_per_tok, expert_params=expert,
                     weight_bytes_per_param=weight_bytes_per_param or dtype_bytes,
                     kv_bytes_per_token=int(math.ceil(layers * kv_values * kv_bytes)))


def load_model(name_or_dir: str, weight_bytes_per_param: float | None = None,
               kv_bytes_per_value: float | None = None) -> ModelSpec:
    """A checkpoint directory, a public config name (PUBLIC_CONFIGS) or an engine preset name."""
    from pdserve.engine.models.arch import ModelArch  # torch comes with it: only when a model is read

    if Path(name_or_dir).is_dir():
        arch, name = ModelArch.from_dir(name_or_dir), Path(name_or_dir).name
    elif name_or_dir in PUBLIC_CONFIGS:
        arch, name = ModelArch.from_dict(PUBLIC_CONFIGS[name_or_dir], name_or_dir), name_or_dir
    else:
        from pdserve.engine.checkpoint import PRESETS, default_model

        if name_or_dir not in PRESETS:
            known = ", ".join(sorted([*PUBLIC_CONFIGS, *PRESETS]))
            raise ValueError(f"model {name_or_dir!r}: not a checkpoint directory or a known name ({known})")
        arch, name = ModelArch.from_dir(default_model(name_or_dir)), name_or_dir
    return from_arch(arch, name, weight_bytes_per_param, kv_bytes_per_value)
