"""Llama-family decoder in plain torch: Llama 2/3, Mistral, Qwen2 (qkv bias, tied embeddings), Qwen3
(q/k norms, an explicit head_dim).

`forward(input_ids, positions)` takes a step's flattened tokens and returns hidden states;
`compute_logits` maps the rows that need sampling to vocabulary logits. Attention metadata and
the KV cache come from the forward context the runner sets. Weights load from Hugging Face
checkpoint names through each layer's own `weight_loader`; the kernels package lays them out for
its kernels after loading, and runs a decode step of a model it can take in one C call
(`kernels/cpu_decoder.py`, which reads these modules' weights by name).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pdserve.engine.attention import Attention
from pdserve.engine.kernels import ops
from pdserve.engine.parallel import SINGLE, ParallelState
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import (LMHead, MergedColumnParallelLinear, QKVParallelLinear,
                                          RMSNorm, RotaryEmbedding, RowParallelLinear, VocabEmbedding, _Linear)
from pdserve.errors import ModelLoadError, UnsupportedModelError


def check_parallel(arch: ModelArch, parallel: ParallelState) -> None:
    """A clear error when the model's shapes cannot be split `parallel.size` ways."""
    n = parallel.size
    problems = []
    if arch.num_heads % n:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.num_kv_heads % n and n % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads (neither divisible by {n} nor dividing it)")
    if arch.intermediate_size % n and not (arch.is_moe and parallel.expert_parallel):
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.is_moe and parallel.expert_parallel and arch.num_experts % n:
        problems.append(f"{arch.num_experts} experts")
    if problems:
        raise UnsupportedModelError(f"tensor_parallel_size {n} does not divide this {arch.model_type} model's "
                                    f"{', '.join(problems)}; pick a degree that does")


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: ParallelState):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, bias=arch.qkv_bias, tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        tp_rank=tp.rank, tp_size=tp.size)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, arch.head_dim,
                              scale=arch.head_dim ** -0.5)
        if arch.qk_norm:  # Qwen3: each q and k head normalised (weights shared by the heads) before rotary
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos_sin))

    def attend(self, qkv: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """The projected q, k and v `[tokens, (heads + 2 * kv_heads) * head_dim]` -> the attention's
        output `[tokens, heads * head_dim]` (q/k norms where the model has them, rotary, paged attention)."""
        tokens = qkv.shape[0]
        heads = qkv.view(tokens, -1, self.head_dim)
        nq, nqk = self.num_heads, self.num_heads + self.num_kv_heads
        if hasattr(self, "q_norm"):
            heads[:, :nq] = self.q_norm(heads[:, :nq].reshape(-1, self.head_dim)).view(tokens, nq, -1)
            heads[:, nq:nqk] = self.k_norm(heads[:, nq:nqk].reshape(-1, self.head_dim)).view(tokens, -1,
                                                                                               self.head_dim)
        RotaryEmbedding.apply(heads[:, :nqk], cos_sin)  # q and k heads rotated in one go, in place
        return self._paged_attention(heads)

    def attend_one_token(self, h: torch.Tensor, norm: RMSNorm, cos_sin: torch.Tensor) -> torch.Tensor:
        """`attend` of one token's qkv projection of `norm(h)`, on GEMVs that take the norm in
        (`ops.runs_gemvs`); without q/k norms, rotary and the K/V write too, in the same launch."""
        if hasattr(self, "q_norm"):
            return self.attend(ops.norm_gemv(h, norm.weight, norm.eps, self.qkv_proj.weight), cos_sin)
        qkv = ops.norm_gemv_rotary_write_kv(h, norm.weight, norm.eps, self.qkv_proj.weight, cos_sin, self.num_heads,
                                            *self.attn.step_cache())
        return self._paged_attention(qkv.view(1, -1, self.head_dim), kv_written=True)

    def _paged_attention(self, heads: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """The attention of `[tokens, heads + 2 * kv_heads, head_dim]` (q, k, v heads, rotated)."""
        nq, nqk = self.num_heads, self.num_heads + self.num_kv_heads
        return self.attn(heads[:, :nq], heads[:, nq:nqk], heads[:, nqk:], kv_written=kv_written)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: ParallelState):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       tp_rank=tp.rank, tp_size=tp.size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_rank=tp.rank, tp_size=tp.size)
        self.intermediate_size = intermediate_size // tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, mlp: nn.Module, tp: ParallelState):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, cos_sin: torch.Tensor,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h, this layer's MLP output). In place: h is this forward pass's own residual stream.
        Each residual add happens inside the norm that follows it (one kernel, not two): the
        previous layer's MLP output (`pending`) in this layer's first norm, the attention output in
        its second; this layer's MLP output is left to the next norm. A one-token step on a GPU
        adds both inside the GEMVs before them instead (`_forward_gemvs`) and leaves None."""
        if pending is None and self._runs_gemvs(h):
            return self._forward_gemvs(h, cos_sin), None
        x = self.post_attention_layernorm(h, add=self.self_attn(self.input_layernorm(h, add=pending), cos_sin))
        return h, self.mlp(x)

    def _runs_gemvs(self, h: torch.Tensor) -> bool:
        """A one-token step of a plain Llama layer (dense SwiGLU MLP, no biases, one rank; Qwen3's q/k
        norms are `attend`'s) where `ops.runs_gemvs` takes its weights: on a GPU."""
        a, mlp = self.self_attn, self.mlp
        return (h.shape[0] == 1 and type(a) is LlamaAttention and type(mlp) is LlamaMLP
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                and a.o_proj.tp_size == 1 and a.qkv_proj.bias is None and a.o_proj.bias is None
                and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
                and ops.runs_gemvs(h, a.qkv_proj.weight, a.o_proj.weight, mlp.gate_up_proj.weight,
                                   mlp.down_proj.weight))

    def _forward_gemvs(self, h: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """`forward` on four GEMVs that take the norms, rotary, the K/V write, SwiGLU and both
        residual adds in: h gets this layer's MLP output too (nothing is left pending)."""
        a, mlp, norm2 = self.self_attn, self.mlp, self.post_attention_layernorm
        ops.gemv_add_(a.attend_one_token(h, self.input_layernorm, cos_sin), a.o_proj.weight, h)
        gate_up = ops.norm_gemv(h, norm2.weight, norm2.eps, mlp.gate_up_proj.weight)
        return ops.gemv_add_(gate_up, mlp.down_proj.weight, h, swiglu=True)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_position: int, make_mlp, tp: ParallelState):
        super().__init__()
        self.rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, make_mlp(arch, i, tp), tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos_sin = self.rotary.table(positions)
        pending = None
        for layer in self.layers:
            h, pending = layer(h, cos_sin, pending)
        return self.norm(h, add=pending)


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our merged parameter, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    supports_cuda_graphs = True  # no host syncs in the forward pass (engine/cuda_graphs.py)

    def __init__(self, arch: ModelArch, max_position: int, parallel: ParallelState = SINGLE):
        super().__init__()
        check_parallel(arch, parallel)
        self.arch = arch
        self.parallel = parallel
        self.model = LlamaModel(arch, max_position, self.make_mlp, parallel)
        # A `[vocab, hidden]` holder while loading; `finalize()` turns it into the LMHead.
        self.lm_head = None if arch.tie_word_embeddings else VocabEmbedding(arch.vocab_size, arch.hidden_size,
                                                                            parallel.rank, parallel.size)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches."""
        return self.model.layers[0].self_attn.num_kv_heads

    @staticmethod
    def make_mlp(arch: ModelArch, layer_idx: int, tp: ParallelState) -> nn.Module:
        return LlamaMLP(arch.hidden_size, arch.intermediate_size, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def num_decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: all but the embedding table, of which it reads a row.
        (For a MoE model this counts every expert: an upper bound.)"""
        total = sum(m.num_weight_bytes for m in self.modules() if isinstance(m, _Linear))
        return total + sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                           if "embed_tokens" not in n)

    def finalize(self) -> None:
        """After loading: the LM head, from its checkpoint tensor or the tied embedding. (Each
        module then lays its own weights out in its `finalize`: the loader runs those through the
        kernels package, which packs the linears for the kernel that will run them.)"""
        source = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self.lm_head = LMHead(source.weight.data, self.arch.vocab_size, self.parallel.rank, self.parallel.size)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for a checkpoint tensor; None to skip it."""
        if "rotary_emb.inv_freq" in name or (self.arch.tie_word_embeddings and name == "lm_head.weight"):
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.stacked_params:
                merged, shard = self.stacked_params[part]
                return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        owners = {f"{mod_name}.{p_name}" if mod_name else p_name: mod
                  for mod_name, mod in self.named_modules() for p_name, _ in mod.named_parameters(recurse=False)}
        loaded: set[tuple[str, object]] = set()
        for ckpt_name, tensor in weights:
            mapped = self.map_weight_name(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} does not belong to a "
                                     f"{self.arch.model_type} model of this shape")
            param = params[name]
            expected = self.expected_shape(param, owners[name], shard)
            if expected is not None and tuple(tensor.shape) != expected:
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {expected}")
            loader = getattr(owners[name], "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add((name, shard))
        missing = sorted(n for n, s in self.expected_tensors() if (n, s) not in loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def expected_shape(self, param: nn.Parameter, owner: nn.Module, shard) -> tuple[int, ...] | None:
        """The full (unsharded) checkpoint shape for a parameter shard, when cheap to state."""
        if shard is None and getattr(owner, "tp_size", 1) == 1:
            return tuple(param.shape)
        return None

    def expected_tensors(self) -> list[tuple[str, object]]:
        out = []
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                out += [(name, s) for s in ("q", "k", "v")]
            elif name.endswith("gate_up_proj.weight"):
                out += [(name, 0), (name, 1)]
            else:
                out.append((name, None))
        return out
