"""How long one engine step takes on an accelerator: a roofline over bytes moved and FLOPs done.

In: a `ModelSpec`, an `Accelerator`, the tensor-parallel degree, and what the step computes (tokens,
the context tokens whose KV it reads, the (query, context) pairs its attention scores). Out:
seconds. A step streams the weights it touches and the KV it attends over from memory and does
2 FLOPs per multiply-add; it takes the longer of the two (they overlap), plus the accelerator's
fixed per-step overhead, plus, under tensor parallelism, two all-reduces of the activations per
layer over the replica's interconnect (ring: 2(tp-1)/tp of the bytes each). A profile marked
additive (a CPU) takes the sum of the two instead, and may read KV at a rate of its own.

It does not know about requests, batches or queues: the simulated replicas count those.
"""

from __future__ import annotations

from pdserve.simulate.hardware import Accelerator
from pdserve.simulate.model import ModelSpec

ACTIVATION_BYTES = 2  # bf16 activations in the tensor-parallel all-reduces


class StepCost:
    """A step's seconds for one (model, accelerator, tp) replica; constants computed once."""

    def __init__(self, model: ModelSpec, accelerator: Accelerator, tp: int = 1):
        if tp < 1:
            raise ValueError("tensor-parallel degree must be at least 1")
        self.model, self.accelerator, self.tp = model, accelerator, tp
        self._kv_s_per_token = model.kv_bytes_per_token / tp / (accelerator.attention_bytes_per_s
                                                                  or accelerator.hbm_bytes_per_s)
        self._additive = accelerator.is_additive
        self._flop_s_per_token = model.flops_per_token / tp / accelerator.flops_per_s
        self._flop_s_per_pair = model.attention_flops_per_pair / tp / accelerator.flops_per_s
        self._hbm = accelerator.hbm_bytes_per_s * tp
        self._comm_s_per_token = (0.0 if tp == 1 else 2 * model.num_layers * model.hidden_size * ACTIVATION_BYTES
                                  * 2 * (tp - 1) / tp / accelerator.interconnect_bytes_per_s)
        self._dense_weights_s = model.weight_bytes_read(1) / self._hbm if not model.num_moe_layers else None
        self.overhead_s = accelerator.step_overhead_s

    def seconds(self, num_tokens: int, num_kv_tokens: int, num_attention_pairs: float) -> float:
        """A step computing `num_tokens` tokens that reads `num_kv_tokens` tokens' KV and scores
        `num_attention_pairs` (query, context) pairs."""
        if num_tokens <= 0:
            return 0.0
        weights = self._dense_weights_s if self._dense_weights_s is not None else (
            self.model.weight_bytes_read(num_tokens) / self._hbm)
        memory = weights + num_kv_tokens * self._kv_s_per_token
        compute = num_tokens * self._flop_s_per_token + num_attention_pairs * self._flop_s_per_pair
        busy = memory + compute if self._additive else (memory if memory > compute else compute)
        return self.overhead_s + busy + num_tokens * self._comm_s_per_token


def prefill_pairs(num_cached: int, num_tokens: int) -> float:
    """(query, context) pairs of a prefill chunk of `num_tokens` after `num_cached` tokens
    (causal: the i-th new token sees the cached ones, the earlier new ones and itself)."""
    return num_tokens * num_cached + num_tokens * (num_tokens + 1) / 2
