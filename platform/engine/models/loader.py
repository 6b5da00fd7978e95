"""Load a local Hugging Face checkpoint into the matching model file.

In: a directory with config.json and one or more *.safetensors files (sharded checkpoints are
read through model.safetensors.index.json). Out: a model in eval mode on the requested device and
dtype. Errors: `ModelLoadError` / `UnsupportedModelError` saying what is missing or wrong.
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.mixtral import MixtralForCausalLM
from pdserve.engine.parallel import SINGLE, ParallelState
from pdserve.errors import ModelLoadError

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (pytorch .bin files are not supported)")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: not a valid safetensors file ({e})") from e


def round_weight_matrices(model: torch.nn.Module, dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """Round every weight matrix (linears, experts, embeddings; not norms or biases) to
    `weight_dtype`'s precision, kept in `dtype`. Only bf16 under fp32 is supported: every bf16
    number is an fp32 one, so the CPU kernels can store the matrices in bf16 and widen them
    exactly, and every other path (torch, another device) computes the same products."""
    if (dtype, weight_dtype) != (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"weight_dtype {weight_dtype} applies to float32 models; this one loads as {dtype} "
                             f"(set dtype: float32, or weight_dtype: auto)")
    for p in model.parameters():
        if p.dim() >= 2:
            p.data = p.data.to(weight_dtype).to(dtype)


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               max_position: int | None = None, parallel: ParallelState = SINGLE,
               weight_dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, ModelArch]:
    """The checkpoint as a model in eval mode; under tensor parallelism, this rank's shard of it.
    `weight_dtype` bf16 under an fp32 model: weight-only bf16 (see `round_weight_matrices`)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory; pass a local checkpoint directory")
    arch = ModelArch.from_dir(model_dir)
    files = safetensors_files(model_dir)
    dtype = dtype or arch.dtype
    model = MODEL_CLASSES[arch.family](arch, max_position or arch.context_len, parallel)
    for p in model.parameters():  # buffers (rotary tables) stay fp32
        p.data = p.data.to(dtype=dtype, device=device)
    model.to(device)
    model.load_weights(iter_weights(files))
    if weight_dtype not in (None, dtype):
        round_weight_matrices(model, dtype, weight_dtype)
    model.finalize(packed_dtype=weight_dtype or torch.float32)
    return model.eval(), arch
