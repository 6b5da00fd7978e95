"""Building blocks of the model files: norms, rotary embeddings, and linears named for their
tensor-parallel role.

Each parallel layer owns its shard and loads it itself (`weight_loader(param, full_tensor,
shard_id)` narrows the checkpoint tensor to this rank's part), so tensor parallelism changes shapes
and adds one all-reduce, never the model code. With `tp_size == 1` they are plain linears.
Parameters are created empty in the checkpoint's `[out, in]` layout and the loader fills them; then
`finalize()` packs each weight once for the CPU, as `kernels/ops.py` chooses: for pdserve's C
matmul (column panels, fp32 or, with `weight_dtype: bfloat16`, bf16) for fp32 models where the
kernels are built, else for oneDNN's matmul. The C matmul is faster than oneDNN at batch-1 decode,
where a step streams its weights (the whole decode step runs in C there), level with it at a few
rows, and behind it on prefill chunks: 0.83x at 16-2048 rows with AVX-512 on the Zen 5 machines of
the 2026-11-24 runs (benchmarks/cpu_linear.py; figures in benchmarks/RESULTS.md). Prefill runs on
it all the same: a second packing of every weight, for oneDNN, would double the weights' memory.
The norm and the rotary embedding run on `kernels/ops.py` too, which picks the C kernels, fused
Triton kernels on a GPU, or torch per op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import ops
from pdserve.errors import UnsupportedModelError


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _narrow(loaded: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    shard = loaded.shape[dim] // size
    return loaded.narrow(dim, rank * shard, shard)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)
        # 0-dim tensors, not Python floats, for the fp32 torch path: an op with a Python scalar
        # costs several microseconds more on CPU, and a decode step runs two norms per layer.
        self.register_buffer("_eps", torch.tensor(eps), persistent=False)
        self.register_buffer("_inv_size", torch.tensor(1.0 / hidden_size), persistent=False)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `add`, x += add first, in place (the residual add before the norm)."""
        return ops.rms_norm(x, self.weight, self.eps, add, scalars=(self._eps, self._inv_size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)


class _Linear(nn.Module):
    """Shared by the parallel linears: the checkpoint's `[out, in]` while loading; after
    `finalize()`, packed for the CPU (see the module docstring), else unchanged."""

    packed: torch.Tensor | None = None
    packed_for: str | None = None  # "pdserve" (the C matmul) or "onednn": `ops.pack_linear`

    def finalize(self, packed_out: torch.Tensor | None = None) -> None:
        """packed_out: where to pack for pdserve's matmul (from `cpu_kernels.packed_arena`), when
        `packs_for_pdserve`; else a buffer of its own."""
        self.out_features = self.weight.shape[0]
        self.packed, self.packed_for = ops.pack_linear(self.weight.data, packed_out)
        stored = self.packed if self.packed_for == "pdserve" else self.weight  # pdserve's may hold bf16
        self.num_weight_bytes = self.weight.numel() * stored.element_size()
        if self.packed is not None:
            self.weight = None  # the packed copy is the weight now

    @property
    def packs_for_pdserve(self) -> bool:
        """Whether `finalize` packs the weight for pdserve's C matmul (fp32 on CPU, kernels built)."""
        return self.weight is not None and ops.packs_linear_for_c(self.weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.linear(x, self.weight, self.packed, self.packed_for, self.out_features, bias)


class ColumnParallelLinear(_Linear):
    """y = x W^T + b with W's output rows split across ranks (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = _param(out_features // tp_size, in_features)
        self.bias = _param(out_features // tp_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_narrow(loaded, 0, self.tp_rank, self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections); shard_id = index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(_narrow(loaded, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; heads split across ranks, KV heads replicated when
    there are fewer KV heads than ranks. shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_replicas = max(1, tp_size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.num_kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(_Linear):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = _param(out_features, in_features // tp_size)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        torch.distributed.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            param.data.copy_(loaded)
        else:
            param.data.copy_(_narrow(loaded, 1, self.tp_rank, self.tp_size))


class VocabEmbedding(nn.Module):
    """Token embedding with the vocabulary's rows split across ranks (padded to a multiple of the
    degree); its rows double as the LM head when the checkpoint ties them. A rank looks up the ids
    in its range, zeros for the rest, and the all-reduce assembles every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.start = tp_rank * self.rows_per_rank
        self.weight = _param(self.rows_per_rank, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        torch.distributed.all_reduce(out)
        return out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.rows_per_rank]
        param.data.zero_()  # padding rows past the vocabulary
        param.data[:rows.shape[0]].copy_(rows)


class LMHead(_Linear):
    """hidden -> vocabulary logits, from the LM head's checkpoint tensor `[vocab, hidden]` or, when
    the checkpoint ties them, from the embedding table (then it keeps a copy of its own). Under
    tensor parallelism each rank scores its vocabulary rows and rank 0 gathers them; the other
    ranks return None. Made after loading; `finalize()` it like the other linears."""

    def __init__(self, weight: torch.Tensor, vocab_size: int | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size or weight.shape[0], tp_rank, tp_size
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self._matmul(hidden, None)
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        torch.distributed.gather(local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size] if parts else None


# -- rotary position embedding --------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_position_embeddings: int, max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for a rope config (HF semantics).
    `max_position`: the longest sequence this engine serves (longrope picks its factors by it)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind in ("longrope", "su"):  # Phi-3; "su" is its older name
        return _longrope_inv_freq(head_dim, theta, scaling, max_position_embeddings,
                                  max_position or max_position_embeddings)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn, longrope)")


def _longrope_inv_freq(dim: int, base: float, s: dict, max_pos: int, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: frequencies divided per dimension by `short_factor` within the pretraining length,
    by `long_factor` past it. transformers switches a whole forward pass to the long factors once
    its sequence passes `original_max_position_embeddings`, after its earlier keys were cached
    rotated by the short ones; here one table serves every sequence, so the rule is per engine:
    the long factors when this engine serves sequences past the pretraining length (vLLM's rule),
    else the short ones. Sequences that stay within it, or pass it from their first step, get
    transformers' numbers either way."""
    original = int(s["original_max_position_embeddings"])
    factors = s["long_factor"] if max_position > original else s["short_factor"]
    if len(factors) != dim // 2:
        raise UnsupportedModelError(f"longrope factors have {len(factors)} entries; head_dim {dim} needs {dim // 2}")
    factor = s.get("factor") or max_pos / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents), float(attention_factor)


def _yarn_inv_freq(dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    original = s.get("original_max_position_embeddings") or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) from a precomputed cos/sin table.

    `table(positions)` gathers the step's rows once per forward pass; every layer then rotates its
    q and k heads together with `apply`, in place.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 max_position_embeddings: int):
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, 2, head_dim // 2]: cos and sin side by side, one gather per step.
        self.register_buffer("cos_sin", torch.stack((freqs.cos(), freqs.sin()), dim=1) * attention_factor,
                             persistent=False)
        self.head_dim = head_dim

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """cos and sin rows for the step's positions, `[tokens, 2, head_dim // 2]`."""
        return self.cos_sin[positions]

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x `[tokens, heads, head_dim]` (tokens at any stride) in place; returns x."""
        return ops.rotary_(x, cos_sin)
