"""Block-wise FP8 checkpoints as the DeepSeek-V3 and Qwen3 FP8 releases store them, made from a
generated one: each linear weight as float8_e4m3fn with a fp32 `<name>_scale_inv` per block, the
rest as stored, a `quantization_config` of type fp8 in config.json.

`write_fp8_checkpoint(src, out, block)` writes two shards with an index and returns the
dequantized weights (what an fp32 checkpoint of the same model holds); `reference_dequantize` is the
definition written the slow way, for tests to compare the engine's against.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.loader import checkpoint_tensors

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# tiny-qwen3: hidden 64, q 128, kv 64, intermediate 160: 48 leaves a ragged edge block on every side.
BLOCK = (48, 48)


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv per block) as DeepSeek's and transformers' quantizers
    make them: each block scaled so its largest magnitude maps to the format's maximum."""
    (rows, cols), (bm, bn) = w.shape, block
    scale = torch.empty(-(-rows // bm), -(-cols // bn))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, written the slow way: every element times its block's scale."""
    rows, cols = q.shape
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * full


def quantization_config(block=BLOCK, **changes) -> dict:
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def write_fp8_checkpoint(src: Path, out: Path, block=BLOCK) -> dict[str, torch.Tensor]:
    """`src` with its linear weights block-quantized, in two shards with an index. Layer 0's scales
    go to the second shard and layer 1's to the first, so a scale comes both after and before its
    weight. Returns the dequantized weights (what an fp32 checkpoint of the same model holds)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(block)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    linear = {name for name, _, kind in checkpoint_tensors(ModelArch.from_dict(cfg)) if kind == "linear"}
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                  "model-00002-of-00002.safetensors": {}}
    first, second = shards
    dequantized = {}
    for name, t in tensors.items():
        layer1 = name.startswith("model.layers.1.")
        if name in linear:
            q, scale = quantize_block_fp8(t, block)
            shards[second if layer1 else first][name] = q
            shards[first if layer1 else second][name + "_scale_inv"] = scale
            dequantized[name] = reference_dequantize(q, scale, block)
        else:  # embeddings, norms, LM head stay as stored (modules_to_not_convert)
            shards[first][name] = t
            dequantized[name] = t
    for file, part in shards.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dequantized
