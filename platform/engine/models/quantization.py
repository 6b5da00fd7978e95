"""Quantized checkpoints: which `quantization_config`s load, and block-wise FP8 dequantized at load.

In: the `quantization_config` of a config.json (`parse_quantization`), then the checkpoint's
(name, tensor) stream (`dequantize_fp8_weights`). Out: a frozen `Fp8BlockScheme` (None for an
unquantized checkpoint), then the same stream with every float8 weight replaced, under its own
name, by the dequantized tensor in the compute dtype, and the scale tensors gone.

What loads is the format of the official DeepSeek-V3/R1 and Qwen3 FP8 releases (and of
`transformers`' FineGrainedFP8): `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [bm, bn]`,
dynamic activations. A quantized weight `W` of shape [out, in] is stored as float8_e4m3fn beside
`<W's name>_scale_inv` of shape [ceil(out/bm), ceil(in/bn)] (fp32 in DeepSeek's, any float type
accepted); the weight is `W.float() * scale_inv` over each bm x bn block, edge blocks ragged
(DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks). Which tensors are quantized is read
from their dtype, so `modules_to_not_convert` (embeddings, norms, LM head, router gates) needs no
parsing: those tensors are stored in bf16/fp32 and pass through. Anything else (another
quant_method, per-tensor FP8, e5m2, static activation scales, FP4 experts) is refused by name.

The matmuls then run in the compute dtype: native FP8 kernels are later work. Memory: one tensor
is dequantized at a time and the model takes it before the next is read, so the host never holds
the checkpoint twice. Scales are read by name where the checkpoint keeps them (`read_tensor`, any
shard), so no weight waits in memory for a scale in a later shard.

Knows nothing of models, files or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from pdserve.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale_inv"
SUPPORTED = "quant_method fp8 with fmt e4m3, block-wise weight_block_size [m, n] and dynamic activations"


@dataclass(frozen=True)
class Fp8BlockScheme:
    """Block-wise FP8 weights: one scale per `block_rows` x `block_cols` block of each weight."""
    block_rows: int
    block_cols: int


def parse_quantization(qcfg: object, source: str = "config") -> Fp8BlockScheme | None:
    """The scheme a config.json's `quantization_config` asks for; `UnsupportedModelError` naming the
    field and value for anything else."""
    if qcfg is None:
        return None

    def refuse(field: str, value: object, why: str = "") -> UnsupportedModelError:
        return UnsupportedModelError(f"{source}: quantization_config.{field} {value!r} is not supported"
                                     f"{why} (supported: {SUPPORTED}, dequantized to the compute dtype at load)")

    if not isinstance(qcfg, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {qcfg!r}")
    method = qcfg.get("quant_method")
    if method != "fp8":
        raise refuse("quant_method", method)
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse("fmt", fmt)
    block = qcfg.get("weight_block_size")
    if block is None:
        raise refuse("weight_block_size", block, ": per-tensor FP8 scales")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse("weight_block_size", block, ": expected two positive integers")
    activations = qcfg.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise refuse("activation_scheme", activations, ": static activation scales")
    scale_fmt = qcfg.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):  # ue8m0: DeepSeek-V3.1's power-of-two scales, still floats
        raise refuse("scale_fmt", scale_fmt)
    experts = qcfg.get("expert_dtype", "fp8")
    if experts != "fp8":
        raise refuse("expert_dtype", experts)
    return Fp8BlockScheme(int(block[0]), int(block[1]))


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """`weight` (float8, [..., rows, cols]) times its per-block `scale_inv` ([..., ceil(rows/block_rows),
    ceil(cols/block_cols)]), in `dtype`. Computed in fp32, in place on one fp32 copy of the weight."""
    import torch  # (here: reading a config's quantization_config, as the gateway does, must not load it)

    rows, cols = weight.shape[-2:]
    num_col_blocks = -(-cols // block_cols)
    out = weight.to(torch.float32)
    # One scale row per weight row ([..., rows, col blocks]: 1/block_cols of the weight's size).
    scales = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    whole = cols // block_cols * block_cols
    if whole:
        out[..., :whole].view(*out.shape[:-1], whole // block_cols, block_cols).mul_(
            scales[..., :whole // block_cols, None])
    if whole < cols:  # the ragged last column block
        out[..., whole:].mul_(scales[..., num_col_blocks - 1:])
    return out.to(dtype)


def dequantize_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8BlockScheme,
                           dtype: torch.dtype, read_tensor: Callable[[str], torch.Tensor | None],
                           keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stream with each float8_e4m3fn weight dequantized to `dtype` and the
    `*_scale_inv` tensors dropped; every other tensor as stored. `read_tensor(name)` returns any
    tensor of the checkpoint by name (None if it holds none); `keep(name)` False marks a tensor
    the model will skip (DeepSeek's multi-token-prediction layer): passed on as stored, not
    dequantized. `ModelLoadError` names a missing, misshapen or orphaned scale."""
    import torch

    fp8_names: set[str] = set()
    scale_names: list[str] = []
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            scale_names.append(name)
            continue
        if not tensor.dtype.is_floating_point or tensor.itemsize != 1:  # not float8: stored unquantized
            yield name, tensor
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}; quantization_config.fmt e4m3 "
                                 f"stores float8_e4m3fn")
        fp8_names.add(name)
        if not keep(name):
            yield name, tensor
            continue
        yield name, dequantize_block_fp8(tensor, _scale_for(name, tensor, scheme, read_tensor),
                                         scheme.block_rows, scheme.block_cols, dtype)
    orphans = [s for s in scale_names if s.removesuffix(SCALE_SUFFIX) not in fp8_names]
    if orphans:
        raise ModelLoadError(f"checkpoint holds {len(orphans)} scales without a float8 weight beside them, "
                             f"e.g. {orphans[:3]}")


def _scale_for(name: str, weight: torch.Tensor, scheme: Fp8BlockScheme,
               read_tensor: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
    scale_name = name + SCALE_SUFFIX
    scale = read_tensor(scale_name)
    if scale is None:
        raise ModelLoadError(f"checkpoint tensor {name!r} is float8_e4m3fn but its scale {scale_name!r} is missing "
                             f"(block-wise FP8 keeps one beside each quantized weight)")
    if weight.dim() < 2:
        raise ModelLoadError(f"checkpoint tensor {name!r} is float8 with shape {tuple(weight.shape)}; "
                             f"block-wise FP8 quantizes matrices only")
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // scheme.block_rows), -(-cols // scheme.block_cols))
    if tuple(scale.shape) != expected:
        raise ModelLoadError(f"checkpoint tensor {scale_name!r} has shape {tuple(scale.shape)}; weight_block_size "
                             f"[{scheme.block_rows}, {scheme.block_cols}] over {tuple(weight.shape)} implies {expected}")
    if not scale.dtype.is_floating_point:
        raise ModelLoadError(f"checkpoint tensor {scale_name!r} is {scale.dtype}; scales are stored as floats")
    return scale
