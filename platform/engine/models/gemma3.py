"""Gemma 3's language model in plain torch (`Gemma3ForCausalLM`, and the text half of
`Gemma3ForConditionalGeneration` checkpoints, whose vision tensors are skipped).

What differs from the Llama block (llama.py), each as transformers' modeling_gemma3 computes it:
- layers interleave sliding-window attention (each query sees its last `sliding_window`
  positions) with global attention, as `layer_types` says; the two kinds rotate by their own
  rotary settings (`rope_parameters` per layer type, or `rope_theta` / `rope_local_base_freq`);
- q and k are RMS-normalised per head before rotary, and scores are scaled by
  `query_pre_attn_scalar ** -0.5`;
- four norms a layer: after attention and after the MLP too, each output normalised before it
  joins the residual stream; every norm scales by `1 + weight` (folded into the weight as it
  loads, so the norms run on the shared kernels);
- the MLP's activation is gelu (tanh approximation); the embedding is scaled by sqrt(hidden) in
  the compute dtype; the final logits may be soft-capped; the LM head is tied by default.

Which KV blocks a sliding layer keeps is the KV cache's business (kv_cache.py, layer groups); here
the window is the attention layer's (attention.py), which every paged attention kernel takes. The
decode step is captured as a CUDA graph on a GPU; on a CPU it does not run as one C call (the C
decode step is the Llama block's: no windows, extra norms or gelu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import Attention
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import (MergedColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                          VocabEmbedding)
from pdserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, check_parallel
from pdserve.engine.parallel import SINGLE, ParallelState

# Checkpoint prefixes of the language model inside a Gemma3ForConditionalGeneration checkpoint:
# transformers >= 4.52 writes the first pair, earlier releases the second.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm scales by `1 + weight`: the weight is stored so as it loads."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.float() + 1.0)


class Gemma3Attention(LlamaAttention):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: ParallelState):
        super().__init__(arch, layer_idx, tp)
        window = arch.layer_windows[layer_idx]
        self.is_sliding = window is not None
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, arch.head_dim,
                              scale=arch.query_pre_attn_scalar ** -0.5, sliding_window=window)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)


class GeluMLP(nn.Module):
    """gelu_tanh(gate) * up, then down (Gemma's gated MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: ParallelState):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       tp_rank=tp.rank, tp_size=tp.size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_rank=tp.rank, tp_size=tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: ParallelState):
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.self_attn = Gemma3Attention(arch, layer_idx, tp)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.mlp = GeluMLP(arch.hidden_size, arch.intermediate_size, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.is_sliding = self.self_attn.is_sliding

    def forward(self, h: torch.Tensor, cos_sin: torch.Tensor,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, this layer's normalised MLP output), as llama.DecoderLayer: each residual add happens
        inside the norm after it; the normalised attention output joins h in the pre-MLP norm."""
        attn = self.self_attn(self.input_layernorm(h, add=pending), cos_sin)
        x = self.pre_feedforward_layernorm(h, add=self.post_attention_layernorm(attn))
        return h, self.post_feedforward_layernorm(self.mlp(x))


class Gemma3Model(nn.Module):
    def __init__(self, arch: ModelArch, max_position: int, tp: ParallelState):
        super().__init__()
        self.rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings)
        self.rotary_local = RotaryEmbedding(arch.head_dim, max_position, arch.local_rope_theta,
                                            arch.local_rope_scaling, arch.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, tp.rank, tp.size)
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size ** 0.5), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)
        h = embeddings * self.embed_scale.to(embeddings.dtype)  # sqrt(hidden) rounded to the compute dtype
        tables = (self.rotary.table(positions), self.rotary_local.table(positions))
        pending = None
        for layer in self.layers:
            h, pending = layer(h, tables[layer.is_sliding], pending)
        return self.norm(h, add=pending)


class Gemma3ForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = True  # the sliding layers' window is the Triton kernels' (no host syncs)
    runs_in_c_decoder = False  # kernels/cpu_decoder.py: the C decode step has no windows or extra norms

    def __init__(self, arch: ModelArch, max_position: int, parallel: ParallelState = SINGLE):
        nn.Module.__init__(self)
        check_parallel(arch, parallel)
        self.arch = arch
        self.parallel = parallel
        self.model = Gemma3Model(arch, max_position, parallel)
        self.lm_head = None if arch.tie_word_embeddings else VocabEmbedding(arch.vocab_size, arch.hidden_size,
                                                                            parallel.rank, parallel.size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is None or logits is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """The language model's tensors under their Gemma3ForCausalLM names; vision tensors skipped."""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        return super().map_weight_name(name)
