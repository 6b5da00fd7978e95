"""The model files' elementwise ops, each on the fastest kernel that takes its tensors: pdserve's C
kernels on CPU (`cpu_kernels`: fp32, built), the fused Triton kernels on a GPU (`triton_fused`),
else torch. The torch code here is the reference the other two are tested against.

- `rms_norm(x, weight, eps, add=None)`: `weight * x / sqrt(mean(x^2) + eps)` over the last
  dimension; with `add`, x += add first, in place (the residual add fused into the next norm).
- `rotary_(x, cos_sin)`: neox-style rotary embedding (rotate halves) of x `[tokens, heads,
  head_dim]` in place, by cos_sin `[tokens, 2, head_dim // 2]` (cos, then sin; fp32).
- `silu_mul(gate_up)`: `silu(gate) * up` of `[tokens, 2 * inter]` holding gate and up side by side.

It knows nothing of layers or models: tensors in, tensors out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels, triton_fused


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_fused.HAS_TRITON


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None,
             scalars: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """norm(x) as a new tensor; with `add`, x += add first, in place. `scalars`: eps and
    1 / hidden as 0-dim tensors on x's device, for the fp32 torch path (an op with a Python
    scalar costs several microseconds more on CPU; a decode step runs two norms per layer)."""
    if cpu_kernels.usable(x, weight) and x.dim() == 2 and x.is_contiguous():
        return cpu_kernels.rms_norm(x, weight, eps, add)
    if _on_gpu(x) and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype:
        return triton_fused.rms_norm(x, weight, eps, add)
    return _rms_norm_torch(x, weight, eps, add, scalars)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None,
                    scalars: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    if add is not None:
        x += add
    if x.dtype == torch.float32:
        eps_t, inv_size = scalars if scalars is not None else (x.new_tensor(eps), x.new_tensor(1.0 / x.shape[-1]))
        mean_square = torch.addcmul(eps_t, (x * x).sum(-1, keepdim=True), inv_size)
        return x * mean_square.rsqrt_() * weight
    # Normalise in fp32 as the reference implementations do, then scale in the input dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]` (tokens at any stride) in place; returns x."""
    if cpu_kernels.usable(x, cos_sin) and x.stride(1) == x.shape[2]:
        return cpu_kernels.rotary_(x, cos_sin)
    if _on_gpu(x) and x.stride(1) == x.shape[2] and x.stride(2) == 1 and cos_sin.stride(2) == 1:
        return triton_fused.rotary_(x, cos_sin)
    return _rotary_torch(x, cos_sin)


def _rotary_torch(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
    x1, x2 = (x if x.dtype == torch.float32 else x.float()).chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[tokens, 2 * inter]` (gate, then up) -> `silu(gate) * up` `[tokens, inter]`."""
    if cpu_kernels.usable(gate_up) and gate_up.is_contiguous():
        return cpu_kernels.silu_mul(gate_up)
    if _on_gpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return triton_fused.silu_mul(gate_up)
    return _silu_mul_torch(gate_up)


def _silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
