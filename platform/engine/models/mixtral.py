"""Mixtral-style sparse MoE decoder: Llama attention, and a top-k routed mixture of SwiGLU experts.

Experts are stored stacked (`w13`: gate and up `[experts, 2*intermediate, hidden]`, `w2`:
`[experts, hidden, intermediate]`) so expert parallelism can later own a contiguous range of
them. Routing follows Mixtral: softmax over all experts in fp32, top-k, renormalise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import _param
from pdserve.engine.models.llama import LlamaForCausalLM


class MixtralMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.w13 = _param(num_experts, 2 * intermediate_size, hidden_size)
        self.w2 = _param(num_experts, hidden_size, intermediate_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        expert, which = shard_id
        if which == "w2":
            param.data[expert].copy_(loaded)
        else:
            offset = 0 if which == "w1" else self.intermediate_size
            param.data[expert, offset:offset + self.intermediate_size].copy_(loaded)

    def finalize(self) -> None:
        """Store experts as `[experts, in, out]` for `x @ W` (see layers.py)."""
        self.w13 = nn.Parameter(self.w13.data.transpose(1, 2).contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.data.transpose(1, 2).contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in top_i.unique().tolist():
            token, slot = (top_i == expert).nonzero(as_tuple=True)
            gate, up = torch.mm(x[token], self.w13[expert]).chunk(2, dim=-1)
            y = torch.mm(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, token, y * top_w[token, slot, None])
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(arch: ModelArch) -> nn.Module:
        return MixtralMoE(arch.hidden_size, arch.intermediate_size, arch.num_experts, arch.num_experts_per_tok)

    def map_weight_name(self, name: str):
        # model.layers.N.block_sparse_moe.experts.E.w1.weight -> model.layers.N.mlp.w13, (E, "w1")
        if ".block_sparse_moe." in name:
            prefix, rest = name.split(".block_sparse_moe.")
            if rest == "gate.weight":
                return f"{prefix}.mlp.gate.weight", None
            _, expert, which, _ = rest.split(".")
            return f"{prefix}.mlp.{'w2' if which == 'w2' else 'w13'}", (int(expert), which)
        return super().map_weight_name(name)

    def expected_shape(self, param, owner, shard):
        if isinstance(owner, MixtralMoE) and shard is not None:
            return None
        return super().expected_shape(param, owner, shard)

    def expected_tensors(self):
        out = []
        for name, shard in super().expected_tensors():
            if name.endswith("mlp.w13"):
                out += [(name, (e, w)) for e in range(self.arch.num_experts) for w in ("w1", "w3")]
            elif name.endswith("mlp.w2"):
                out += [(name, (e, "w2")) for e in range(self.arch.num_experts)]
            else:
                out.append((name, shard))
        return out
