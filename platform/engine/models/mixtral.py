"""Sparse MoE decoders: Llama attention (Qwen3's, with q/k norms, for Qwen3-MoE) and a top-k routed
mixture of SwiGLU experts. Mixtral and Qwen3-MoE differ only in names and routing details: Qwen3-MoE
renormalises the chosen weights only where its config says (`norm_topk_prob`), gives experts an
intermediate size of their own, and may keep dense MLPs in some layers (`mlp_only_layers`,
`decoder_sparse_step`).

Experts are stored stacked (`w13`: gate and up `[experts, 2*intermediate, hidden]`, `w2`:
`[experts, hidden, intermediate]`), so under expert parallelism a rank owns a contiguous range.
Routing: softmax over all experts in fp32, top-k, renormalise (Mixtral always).

`kernels/ops.py` runs the experts: on a GPU with Triton (and no expert parallelism) as fused
kernels that route on the device (no host sync, so the decode step can be captured as a CUDA
graph); elsewhere as a loop over the chosen experts, the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import ops
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.parallel import SINGLE, ParallelState
from pdserve.engine.models.layers import _param
from pdserve.engine.models.llama import LlamaForCausalLM


class MixtralMoE(nn.Module):
    """Top-k routed SwiGLU experts. Under tensor parallelism each rank holds a slice of every
    expert's intermediate dimension and the outputs are all-reduced; with expert parallelism each
    rank holds whole experts, a contiguous range of them, and tokens travel to their experts and
    back with all-to-all (each rank routes its share of the step's tokens, then the shares are
    gathered again). Either way the router (`gate`) is replicated."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 tp: ParallelState = SINGLE, renormalize: bool = True):
        super().__init__()
        self.tp = tp
        self.renormalize = renormalize
        self.ep = tp.expert_parallel and tp.size > 1
        self.top_k = top_k
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // tp.size if self.ep else num_experts
        self.first_expert = tp.rank * self.experts_per_rank if self.ep else 0
        self.intermediate_size = intermediate_size if self.ep else intermediate_size // tp.size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.w13 = _param(self.experts_per_rank, 2 * self.intermediate_size, hidden_size)
        self.w2 = _param(self.experts_per_rank, hidden_size, self.intermediate_size)
        self.is_fused = False  # decided by `finalize`, with the layout

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        expert, which = shard_id
        expert -= self.first_expert
        if not 0 <= expert < self.experts_per_rank:
            return  # another rank's expert
        if not self.ep and self.tp.size > 1:  # this rank's slice of the intermediate dimension
            size = self.intermediate_size
            loaded = loaded.narrow(1 if which == "w2" else 0, self.tp.rank * size, size)
        if which == "w2":
            param.data[expert].copy_(loaded)
        else:
            offset = 0 if which == "w1" else self.intermediate_size
            param.data[expert, offset:offset + self.intermediate_size].copy_(loaded)

    def finalize(self) -> None:
        """Choose the path: the fused kernels keep the checkpoint's `[experts, out, in]`, reading
        weight rows along `in`; the loop stores `[experts, in, out]` for `x @ W` (see layers.py)."""
        self.is_fused = ops.fuses_moe(self.w13, self.ep)
        if not self.is_fused:
            self.w13 = nn.Parameter(self.w13.data.transpose(1, 2).contiguous(), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.data.transpose(1, 2).contiguous(), requires_grad=False)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_i


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep:
            return self._forward_expert_parallel(x)
        top_w, top_i = self._route(x)
        out = ops.moe(x, self.w13, self.w2, top_w, top_i, self.is_fused)
        if self.tp.size > 1:
            torch.distributed.all_reduce(out)
        return out

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        n, size, rank = x.shape[0], self.tp.size, self.tp.rank
        share = -(-n // size)
        mine = x[rank * share:(rank + 1) * share]
        top_w, top_i = self._route(mine)
        # One entry per (token, chosen expert), ordered by expert: owners are contiguous ranges,
        # so this also groups entries by destination rank, and sums run in expert order as in
        # the single-rank path.
        experts = top_i.flatten()
        order = torch.argsort(experts, stable=True)
        experts = experts[order]
        tokens = torch.arange(mine.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        weights = top_w.flatten()[order]
        send = torch.bincount(experts // self.experts_per_rank, minlength=size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        rows = x.new_empty(sum(recv_sizes), x.shape[1])
        dist.all_to_all_single(rows, mine[tokens].contiguous(), recv_sizes, send_sizes)
        row_experts = experts.new_empty(sum(recv_sizes))
        dist.all_to_all_single(row_experts, experts, recv_sizes, send_sizes)
        y = torch.empty_like(rows)
        for expert in row_experts.unique().tolist():
            idx = (row_experts == expert).nonzero(as_tuple=True)[0]
            local = expert - self.first_expert
            y[idx] = ops.expert_mlp(rows[idx], self.w13[local], self.w2[local])
        back = x.new_empty(tokens.numel(), x.shape[1])
        dist.all_to_all_single(back, y, send_sizes, recv_sizes)
        out = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, tokens, back * weights[:, None])
        shares = [torch.empty_like(out) for _ in range(size)]
        dist.all_gather(shares, out)
        return torch.cat(shares)[:n]


class MixtralForCausalLM(LlamaForCausalLM):
    @property
    def supports_cuda_graphs(self) -> bool:
        """One rank with every MoE layer on the fused kernels: otherwise routing reads the chosen
        experts on the host (the loop) or exchanges counts (expert parallelism)."""
        return self.parallel.size == 1 and all(m.is_fused for m in self.modules() if isinstance(m, MixtralMoE))

    @staticmethod
    def make_mlp(arch: ModelArch, layer_idx: int, tp: ParallelState) -> nn.Module:
        if not arch.is_sparse_layer(layer_idx):
            return LlamaForCausalLM.make_mlp(arch, layer_idx, tp)
        return MixtralMoE(arch.hidden_size, arch.moe_intermediate_size or arch.intermediate_size, arch.num_experts,
                          arch.num_experts_per_tok, tp, renormalize=arch.norm_topk_prob)

    # Qwen3-MoE's expert projections by Mixtral's names.
    _EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}

    def map_weight_name(self, name: str):
        # Mixtral: model.layers.N.block_sparse_moe.experts.E.w1.weight -> model.layers.N.mlp.w13, (E, "w1");
        # Qwen3-MoE: model.layers.N.mlp.experts.E.gate_proj.weight -> the same; its gate is mlp.gate already.
        for marker in (".block_sparse_moe.", ".mlp."):
            prefix, sep, rest = name.partition(marker)
            if sep and (rest == "gate.weight" or rest.startswith("experts.")):
                if rest == "gate.weight":
                    return f"{prefix}.mlp.gate.weight", None
                _, expert, proj, _ = rest.split(".")
                which = self._EXPERT_NAMES.get(proj)
                if which is None:
                    return None
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
