"""Phi-3: the Llama block with its projections fused in the checkpoint (`qkv_proj`: q, k and v rows
stacked; `gate_up_proj`: gate, then up) and LongRoPE (layers.py). The fused tensors are split
into their parts as they load, so each part is sharded over tensor-parallel ranks like Llama's."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pdserve.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        arch = self.arch
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]))
                yield from ((name.replace("qkv_proj", part), t) for part, t in parts)
            elif name.endswith("mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
