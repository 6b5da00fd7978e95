"""Block-wise FP8 checkpoints (the DeepSeek-V3 / Qwen3 FP8 format) load dequantized to the compute
dtype: the engine then holds, and generates exactly what it generates from, an fp32 checkpoint of the
dequantized weights. Scales may sit in another shard than their weight; a missing or misshapen scale
and every quantization_config the engine does not implement are typed errors naming what.
(transformers' own loading of the same checkpoint: tests/integration/engine/test_fp8_parity_hf.py.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.checkpoint import make_checkpoint
from pdserve.engine.llm import LLM
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.quantization import dequantize_block_fp8
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ModelLoadError, UnsupportedModelError
from tests.fakes.fp8_checkpoint import (BLOCK, quantization_config, quantize_block_fp8, reference_dequantize,
                                        write_fp8_checkpoint)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (1, 9, 17, 40)]


@pytest.fixture(scope="module")
def fp8_and_reference(tmp_path_factory) -> tuple[Path, Path]:
    """An FP8 tiny-qwen3 checkpoint and the fp32 checkpoint of its dequantized weights."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_checkpoint("tiny-qwen3", root / "src", seed=0)
    dequantized = write_fp8_checkpoint(src, root / "fp8")
    shutil.copytree(src, root / "reference")
    save_file(dequantized, str(root / "reference" / "model.safetensors"), metadata={"format": "pt"})
    return root / "fp8", root / "reference"


def test_fp8_checkpoint_loads_the_dequantized_weights(fp8_and_reference):
    fp8, reference = fp8_and_reference
    assert any(v.endswith("00002.safetensors") and k.startswith("model.layers.0.") and k.endswith("_scale_inv")
               for k, v in json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"].items())
    model, arch = load_model(fp8)
    ref, _ = load_model(reference)
    assert arch.quantization is not None and (arch.quantization.block_rows, arch.quantization.block_cols) == BLOCK
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    bf16, _ = load_model(fp8, torch.bfloat16)  # the compute dtype, rounded once from the fp32 product
    ref16, _ = load_model(reference, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(bf16.parameters(), ref16.parameters()))


def test_fp8_checkpoint_generates_what_its_dequantized_weights_do(fp8_and_reference):
    fp8, reference = fp8_and_reference

    def outputs(path):
        return [(o.token_ids, [lp.logprob for lp in o.logprobs])
                for o in LLM(str(path), block_size=4).generate(PROMPTS, PARAMS)]

    assert outputs(fp8) == outputs(reference)


@pytest.mark.parametrize("shape, block", [((576, 300), (128, 128)), ((64, 160), (48, 48)), ((256, 256), (128, 128)),
                                          ((3, 576, 200), (128, 128))])
def test_dequantize_matches_the_definition_on_ragged_blocks(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    pairs = [quantize_block_fp8(m, block) for m in w.reshape(-1, *shape[-2:])]
    q = torch.stack([p[0] for p in pairs]).reshape(shape)
    scale = torch.stack([p[1] for p in pairs]).reshape(*shape[:-2], *pairs[0][1].shape)
    want = torch.stack([reference_dequantize(a, s, block) for a, s in pairs]).reshape(shape)
    assert torch.equal(dequantize_block_fp8(q, scale, *block, torch.float32), want)
    assert (want - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def _with_shards(fp8: Path, out: Path, edit) -> Path:
    shutil.copytree(fp8, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
    index = out / "model.safetensors.index.json"
    shards = {p.name: load_file(str(p)).keys() for p in out.glob("*.safetensors")}
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, names in shards.items() for n in names}}))
    return out


def test_broken_scales_are_named(fp8_and_reference, tmp_path):
    fp8, _ = fp8_and_reference
    missing = "model.layers.0.mlp.down_proj.weight_scale_inv"
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.down_proj.weight'.*scale.*_scale_inv.*missing"):
        load_model(_with_shards(fp8, tmp_path / "missing", lambda t: t.pop(missing, None)))

    def misshape(t):
        if missing in t:
            t[missing] = t[missing][:, :1].contiguous()
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale_inv.*shape \(2, 1\).*implies \(2, 4\)"):
        load_model(_with_shards(fp8, tmp_path / "misshapen", misshape))

    def orphan(t):
        if "model.norm.weight" in t:
            t["model.norm.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ModelLoadError, match="scales without a float8 weight.*model.norm.weight_scale_inv"):
        load_model(_with_shards(fp8, tmp_path / "orphan", orphan))


@pytest.mark.parametrize("changes, field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
    ({"quant_method": None}, "quant_method None"),
    ({"weight_block_size": None}, "weight_block_size None.*per-tensor"),
    ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"expert_dtype": "fp4"}, "expert_dtype 'fp4'"),
])
def test_quantization_the_engine_does_not_implement_is_refused_by_name(fp8_and_reference, tmp_path, changes, field):
    fp8, _ = fp8_and_reference
    shutil.copytree(fp8, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(**changes)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}.*supported: quant_method fp8"):
        load_model(tmp_path / "ckpt")
