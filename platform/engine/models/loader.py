"""Load a local Hugging Face checkpoint into the matching model file.

In: a directory with config.json and one or more *.safetensors files (sharded checkpoints are
read through model.safetensors.index.json); or, in place of weights, `random_weights.json`
(`{"seed": N}`), for which the weights are drawn on the device, the same on every load of the same
config and seed (`random_weights`): a model at a real one's shapes with no checkpoint to read, as
vLLM's `load_format: dummy` (benchmarks/gpu_suite.py). Out: a model in eval mode on the requested
device and dtype. Errors: `ModelLoadError` / `UnsupportedModelError` saying what is missing or
wrong. Block-wise FP8 checkpoints (quantization.py) load dequantized to `dtype`. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from pdserve.engine.kernels import cpu_decoder
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.engine.models.gemma3 import Gemma3ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.mixtral import MixtralForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.quantization import dequantize_fp8_weights
from pdserve.engine.parallel import SINGLE, ParallelState
from pdserve.errors import ModelLoadError

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM, "phi3": Phi3ForCausalLM,
                 "gemma3": Gemma3ForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}
RANDOM_WEIGHTS_FILE = "random_weights.json"


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


def tensor_reader(files: list[Path]) -> Callable[[str], torch.Tensor | None]:
    """Any tensor of the checkpoint by name, from whichever shard holds it (None if none does): the
    shards' headers are read once and the files stay mapped while the reader lives."""
    shards = {}
    for path in files:
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: not a valid safetensors file ({e})") from e
        shards.update((name, f) for name in f.keys())
    return lambda name: shards[name].get_tensor(name) if name in shards else None


def checkpoint_tensors(arch: ModelArch) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor a Hugging Face checkpoint of `arch` holds, in one fixed
    order; kind is "embedding", "lm_head", "linear", "bias", "router" or "norm". Both of pdserve's
    writers of random weights (`random_weights`, checkpoint.py) draw by this list."""
    h, hd = arch.hidden_size, arch.head_dim
    yield "model.embed_tokens.weight", (arch.vocab_size, h), "embedding"
    for i in range(arch.num_layers):
        pre = f"model.layers.{i}."
        heads = {"q": arch.num_heads, "k": arch.num_kv_heads, "v": arch.num_kv_heads}
        fused = arch.model_type == "phi3"  # Phi-3 stores q, k, v (and gate, up) as one tensor each
        if arch.is_mla:
            yield from _mla_tensors(pre + "self_attn.", arch)
        elif fused:
            yield pre + "self_attn.qkv_proj.weight", (sum(heads.values()) * hd, h), "linear"
        else:
            for proj, n in heads.items():
                yield pre + f"self_attn.{proj}_proj.weight", (n * hd, h), "linear"
        if not arch.is_mla:
            yield pre + "self_attn.o_proj.weight", (h, arch.num_heads * hd), "linear"
        if arch.qkv_bias:
            for proj, n in heads.items():
                yield pre + f"self_attn.{proj}_proj.bias", (n * hd,), "bias"
        if arch.qk_norm:
            yield pre + "self_attn.q_norm.weight", (hd,), "norm"
            yield pre + "self_attn.k_norm.weight", (hd,), "norm"
        if arch.is_sparse_layer(i):
            inter = arch.moe_intermediate_size or arch.intermediate_size
            moe, names = ((pre + "block_sparse_moe.", ("w1", "w3", "w2")) if arch.model_type == "mixtral"
                          else (pre + "mlp.", ("gate_proj", "up_proj", "down_proj")))
            yield moe + "gate.weight", (arch.num_experts, h), "router"
            if arch.model_type == "deepseek_v3":
                yield moe + "gate.e_score_correction_bias", (arch.num_experts,), "bias"
                shared = inter * arch.num_shared_experts
                for n, shape in (("gate_proj", (shared, h)), ("up_proj", (shared, h)), ("down_proj", (h, shared))):
                    if shared:
                        yield f"{moe}shared_experts.{n}.weight", shape, "linear"
            for e in range(arch.num_experts):
                gate, up, down = (f"{moe}experts.{e}.{n}.weight" for n in names)
                yield gate, (inter, h), "linear"
                yield up, (inter, h), "linear"
                yield down, (h, inter), "linear"
        else:
            inter = arch.intermediate_size
            if fused:
                yield pre + "mlp.gate_up_proj.weight", (2 * inter, h), "linear"
            else:
                yield pre + "mlp.gate_proj.weight", (inter, h), "linear"
                yield pre + "mlp.up_proj.weight", (inter, h), "linear"
            yield pre + "mlp.down_proj.weight", (h, inter), "linear"
        yield pre + "input_layernorm.weight", (h,), "norm"
        yield pre + "post_attention_layernorm.weight", (h,), "norm"
        if arch.family == "gemma3":
            yield pre + "pre_feedforward_layernorm.weight", (h,), "norm"
            yield pre + "post_feedforward_layernorm.weight", (h,), "norm"
    yield "model.norm.weight", (h,), "norm"
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", (arch.vocab_size, h), "lm_head"


def _mla_tensors(pre: str, arch: ModelArch) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """DeepSeek-V3's attention tensors (deepseek_v3.py)."""
    h, heads, rank = arch.hidden_size, arch.num_heads, arch.kv_lora_rank
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    if arch.q_lora_rank is None:
        yield pre + "q_proj.weight", (heads * qk, h), "linear"
    else:
        yield pre + "q_a_proj.weight", (arch.q_lora_rank, h), "linear"
        yield pre + "q_a_layernorm.weight", (arch.q_lora_rank,), "norm"
        yield pre + "q_b_proj.weight", (heads * qk, arch.q_lora_rank), "linear"
    yield pre + "kv_a_proj_with_mqa.weight", (rank + arch.qk_rope_head_dim, h), "linear"
    yield pre + "kv_a_layernorm.weight", (rank,), "norm"
    yield pre + "kv_b_proj.weight", (heads * (arch.qk_nope_head_dim + arch.v_head_dim), rank), "linear"
    yield pre + "o_proj.weight", (h, heads * arch.v_head_dim), "linear"


def random_weights(arch: ModelArch, dtype: torch.dtype, device: str | torch.device,
                   seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face checkpoint of `arch`, by its checkpoint name, drawn on
    `device` from one seeded generator in a fixed order: the same tensors on every call with the
    same arguments, so two processes (a prefill and a decode engine) or `transformers` hold the
    very same weights. Scales as checkpoint.py's "peaked" presets (embedding 1, LM head
    8/sqrt(hidden), linears 1.5/sqrt(fan-in), norms 1 +- 0.1): with near-uniform next-token
    distributions, float rounding would flip greedy choices between two runs of one model."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = arch.hidden_size
    head_std = 8.0 / h ** 0.5
    std = {"embedding": head_std if arch.tie_word_embeddings else 1.0, "lm_head": head_std, "bias": 0.1,
           "router": 1.0 / h ** 0.5, "norm": 0.1}
    for name, shape, kind in checkpoint_tensors(arch):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if kind == "linear":
            yield name, tensor.normal_(0.0, 1.5 / shape[-1] ** 0.5, generator=g)
        else:
            yield name, tensor.normal_(1.0 if kind == "norm" else 0.0, std[kind], generator=g)


def _random_weights_seed(path: Path) -> int:
    try:
        seed = json.loads(path.read_text())["seed"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: expected {{\"seed\": <int>}} ({e!r})") from e
    if not isinstance(seed, int):
        raise ModelLoadError(f"{path}: seed must be an integer, got {seed!r}")
    return seed


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
    dtype = dtype or arch.dtype
    model_cls = MODEL_CLASSES[arch.family]
    if (model_dir / RANDOM_WEIGHTS_FILE).is_file():
        seed = _random_weights_seed(model_dir / RANDOM_WEIGHTS_FILE)
        # Built on the device: the fp32 placeholders of an 8B model would take 32 GB of host memory
        # (freed as each becomes `dtype`), and the weights drawn there never cross to the host.
        with torch.device(device):
            model = model_cls(arch, max_position or arch.context_len, parallel)
        weights = random_weights(arch, dtype, device, seed)
    else:
        files = safetensors_files(model_dir)
        weights = iter_weights(files)
        model = model_cls(arch, max_position or arch.context_len, parallel)
        if arch.quantization is not None:  # FP8 checkpoints: dequantized tensor by tensor as they load
            weights = dequantize_fp8_weights(weights, arch.quantization, dtype, tensor_reader(files),
                                             keep=lambda name: model.map_weight_name(name) is not None)
    for p in model.parameters():  # buffers (rotary tables) stay fp32
        p.data = p.data.to(dtype=dtype, device=device)
    model.to(device)
    model.load_weights(weights)
    if weight_dtype not in (None, dtype):
        round_weight_matrices(model, dtype, weight_dtype)
    model.finalize()
    cpu_decoder.lay_out_weights(model, packed_dtype=weight_dtype or torch.float32)
    return model.eval(), arch
