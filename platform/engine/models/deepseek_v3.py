"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, without its multi-token-prediction layers) in plain torch.

What differs from the Llama block (llama.py), each as transformers' modeling_deepseek_v3 computes it:
- multi-head latent attention: q from a low-rank pair (`q_a_proj`, RMSNorm, `q_b_proj`; or one
  `q_proj` where `q_lora_rank` is null); K and V from a shared latent (`kv_a_proj_with_mqa` gives the
  latent and one rotary key shared by every head; the latent is RMS-normalised and expanded by
  `kv_b_proj`). Rotary embeddings turn only the `qk_rope_head_dim` part of q and the shared key,
  by DeepSeek's yarn scaling (layers.py), whose mscale also scales the softmax
  (`mscale(factor, mscale_all_dim) ** 2`). The cache holds the latent (latent_attention.py).
- checkpoints store the rotary dimensions as interleaved pairs (`rope_interleave`): their rows of
  q_b_proj (q_proj) and kv_a_proj_with_mqa are reordered as they load (evens, then odds), so the
  shared neox rotation gives exactly transformers' interleaved rotation, in its output order.
- DeepSeekMoE from layer `first_k_dense_replace` on (dense MLPs before): sigmoid router scores, a
  bias (`e_score_correction_bias`) that steers which experts are chosen but not their weights,
  top-k within the `topk_group` best of `n_group` expert groups (a group scores by its two best),
  weights renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`; shared experts
  (one SwiGLU MLP, `n_shared_experts` wide) added for every token. The routed experts are
  Mixtral's (mixtral.py): tensor or expert parallel the same way.

Tensor parallelism splits the heads: q_b_proj and kv_b_proj by heads, o_proj by its input; the
down-projections to the latent (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated, so
every rank computes and caches the whole latent. The decode step does not run as one C call. On one
GPU it is captured as a CUDA graph (`supports_cuda_graphs`): MLA's absorbed decode runs the Triton
kernel (kernels/triton_mla.py) and the experts the fused ones, both without host syncs.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import ops
from pdserve.engine.latent_attention import LatentAttention
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                          VocabEmbedding)
from pdserve.engine.models.llama import DecoderLayer, LlamaMLP, LlamaModel, check_parallel
from pdserve.engine.models.mixtral import MixtralForCausalLM, MixtralMoE
from pdserve.engine.parallel import SINGLE, ParallelState
from pdserve.errors import ModelLoadError, UnsupportedModelError


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(arch: ModelArch) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a scaled rope that has it."""
    scale = arch.head_dim ** -0.5
    s = arch.rope_scaling or {}
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        scale *= _mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA's projections around `LatentAttention`."""

    def __init__(self, arch: ModelArch, layer_idx: int, tp: ParallelState):
        super().__init__()
        h, heads, eps = arch.hidden_size, arch.num_heads, arch.rms_norm_eps
        self.nope, self.rope, self.rank = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.kv_lora_rank
        qk = self.nope + self.rope
        if arch.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, tp_rank=tp.rank, tp_size=tp.size)
        else:
            self.q_a_proj = ColumnParallelLinear(h, arch.q_lora_rank)  # replicated
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(arch.q_lora_rank, heads * qk, tp_rank=tp.rank, tp_size=tp.size)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(h, self.rank + self.rope)  # replicated: the latent
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + arch.v_head_dim), tp_rank=tp.rank,
                                              tp_size=tp.size)
        self.o_proj = RowParallelLinear(heads * arch.v_head_dim, h, tp_rank=tp.rank, tp_size=tp.size)
        self.num_heads = heads // tp.size
        self.attn = LatentAttention(layer_idx, self.num_heads, self.rank, self.nope, self.rope, arch.v_head_dim,
                                    softmax_scale(arch))

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        kv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat((self.kv_a_layernorm(kv[:, :self.rank].contiguous()), kv[:, self.rank:]), dim=-1)
        RotaryEmbedding.apply(q[:, :, self.nope:], cos_sin)
        RotaryEmbedding.apply(latent[:, None, self.rank:], cos_sin)
        return self.o_proj(self.attn(q, latent, self.kv_b_proj))


class DeepseekV3MoE(MixtralMoE):
    """Mixtral's routed experts with DeepSeek's router (see the module docstring) and shared experts."""

    def __init__(self, arch: ModelArch, tp: ParallelState):
        super().__init__(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts, arch.num_experts_per_tok,
                         tp, renormalize=arch.norm_topk_prob)
        # fp32 whatever the compute dtype, as transformers keeps it: it decides close choices.
        self.register_buffer("e_score_correction_bias", torch.zeros(arch.num_experts), persistent=False)
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.routed_scaling_factor = arch.routed_scaling_factor
        self.shared_experts = (LlamaMLP(arch.hidden_size, arch.moe_intermediate_size * arch.num_shared_experts, tp)
                               if arch.num_shared_experts else None)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In fp32, as transformers' DeepseekV3TopkRouter. Every op has a shape fixed by x's and reads
        nothing back to the host (CUDA graphs capture it with the fused experts)."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view(-1, self.num_experts)
        top_i = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_i)
        if self.renormalize:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return (top_w * self.routed_scaling_factor).to(x.dtype), top_i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class DeepseekV3DecoderLayer(DecoderLayer):
    """llama.DecoderLayer's residual stream around MLA and a dense MLP or DeepSeekMoE."""

    def __init__(self, arch: ModelArch, layer_idx: int, mlp: nn.Module, tp: ParallelState):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = DeepseekV3Attention(arch, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp


class DeepseekV3Model(LlamaModel):
    def __init__(self, arch: ModelArch, max_position: int, make_mlp, tp: ParallelState):
        nn.Module.__init__(self)
        self.rotary = RotaryEmbedding(arch.qk_rope_head_dim, max_position, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(arch, i, make_mlp(arch, i, tp), tp)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def check_deepseek_parallel(arch: ModelArch, parallel: ParallelState) -> None:
    """llama.check_parallel's checks plus the expert widths a tensor-parallel split divides."""
    check_parallel(arch, parallel)
    n, problems = parallel.size, []
    if arch.dense_layers and arch.intermediate_size % n:  # (check_parallel lets it pass under expert parallelism)
        problems.append(f"dense layers' intermediate size {arch.intermediate_size}")
    if not parallel.expert_parallel and arch.moe_intermediate_size % n:
        problems.append(f"expert intermediate size {arch.moe_intermediate_size}")
    if (arch.moe_intermediate_size * arch.num_shared_experts) % n:
        problems.append(f"shared experts' intermediate size {arch.moe_intermediate_size * arch.num_shared_experts}")
    if problems:
        raise UnsupportedModelError(f"tensor_parallel_size {n} does not divide this deepseek_v3 model's "
                                    f"{', '.join(problems)}; pick a degree that does")


class DeepseekV3ForCausalLM(MixtralForCausalLM):
    runs_in_c_decoder = False  # kernels/cpu_decoder.py: the C decode step is the Llama block's

    @property
    def supports_cuda_graphs(self) -> bool:
        """Mixtral's condition (one rank, every MoE layer on the fused Triton experts, the
        group-limited routing on the device) and MLA's decode on the Triton kernel (the torch path
        would gather the block table's whole width every step)."""
        return (MixtralForCausalLM.supports_cuda_graphs.fget(self)
                and ops.runs_latent_attention_on_triton(self.model.embed_tokens.weight.device))

    def __init__(self, arch: ModelArch, max_position: int, parallel: ParallelState = SINGLE):
        nn.Module.__init__(self)
        check_deepseek_parallel(arch, parallel)
        self.arch = arch
        self.parallel = parallel
        self.model = DeepseekV3Model(arch, max_position, self.make_mlp, parallel)
        self.lm_head = None if arch.tie_word_embeddings else VocabEmbedding(arch.vocab_size, arch.hidden_size,
                                                                            parallel.rank, parallel.size)

    @property
    def num_kv_heads(self) -> int:
        """The latent cache has no KV heads: one vector a token, whole on every rank."""
        return 1

    @staticmethod
    def make_mlp(arch: ModelArch, layer_idx: int, tp: ParallelState) -> nn.Module:
        if not arch.is_sparse_layer(layer_idx):
            return LlamaMLP(arch.hidden_size, arch.intermediate_size, tp)
        return DeepseekV3MoE(arch, tp)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                and int(parts[2]) >= self.arch.num_layers:
            return None  # a multi-token-prediction layer (num_nextn_predict_layers): not part of the LM
        if ".self_attn." in name:
            return name, None  # MLA's projections load as they are named (q_proj is not Llama's)
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        biases = {f"model.layers.{i}.mlp.gate.e_score_correction_bias": layer.mlp
                  for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, DeepseekV3MoE)}
        loaded = set()

        def params_only(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in stream:  # the router biases are buffers (fp32): placed here
                if name in biases:
                    if tuple(t.shape) != (self.arch.num_experts,):
                        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, "
                                             f"config.json implies ({self.arch.num_experts},)")
                    biases[name].e_score_correction_bias.copy_(t.float())
                    loaded.add(name)
                else:
                    yield name, t

        weights = self._deinterleave_rope(weights) if self.arch.rope_interleave else weights
        super().load_weights(params_only(weights))
        if len(loaded) != len(biases):
            raise ModelLoadError(f"checkpoint lacks {len(biases) - len(loaded)} tensors, e.g. "
                                 f"{sorted(set(biases) - loaded)[:3]}")

    def _deinterleave_rope(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The rows that make rotary dimensions, reordered from (even, odd) pairs to evens then odds."""
        a = self.arch
        nope, rope = a.qk_nope_head_dim, a.qk_rope_head_dim
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        for name, t in weights:
            if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
                t = t.reshape(a.num_heads, nope + rope, -1)
                t = torch.cat((t[:, :nope], t[:, nope:][:, order]), dim=1).reshape(a.num_heads * (nope + rope), -1)
            elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                t = torch.cat((t[:a.kv_lora_rank], t[a.kv_lora_rank:][order]))
            yield name, t

    def finalize(self) -> None:
        """The LM head, then each layer's absorbed W_UK and W_UV (before the linears are packed)."""
        super().finalize()
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.attn.absorb(attn.kv_b_proj.weight.data)
