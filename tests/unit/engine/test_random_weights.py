"""`random_weights.json` in place of weights: the loader draws a checkpoint's tensors on the device
(benchmarks/gpu_suite.py runs an 8B-shaped model that way). They must be exactly the tensors a
checkpoint of that architecture holds, the same on every load, and load as a file of them would."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.engine.llm import LLM
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.loader import RANDOM_WEIGHTS_FILE, random_weights
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ModelLoadError
from tests.conftest import TINY_PRESETS

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _random_dir(src: str, dst, seed: int):
    """The checkpoint's config and tokenizer, with random_weights.json in place of its weights."""
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", dst / f)
    (dst / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
    return dst


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_names_and_shapes_are_the_checkpoints(checkpoints, preset):
    arch = ModelArch.from_dir(checkpoints[preset])
    with safe_open(f"{checkpoints[preset]}/model.safetensors", framework="pt") as f:
        expected = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    drawn = {name: tuple(t.shape) for name, t in random_weights(arch, torch.float32, "cpu")}
    assert drawn == expected


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral"])
def test_loads_as_a_file_of_the_same_tensors(checkpoints, preset, tmp_path):
    src = checkpoints[preset]
    random_dir = _random_dir(src, tmp_path / "random", seed=7)
    file_dir = _random_dir(src, tmp_path / "file", seed=7)
    (file_dir / RANDOM_WEIGHTS_FILE).unlink()
    save_file(dict(random_weights(ModelArch.from_dir(src), torch.float32, "cpu", seed=7)),
              str(file_dir / "model.safetensors"))
    other_seed = _random_dir(src, tmp_path / "other", seed=8)

    prompts = [[5, 17, 33, 2, 9], [40, 41, 42]]
    tokens = {d.name: [c.token_ids for c in LLM(str(d)).generate(prompts, GREEDY)]
              for d in (random_dir, file_dir, other_seed)}
    assert tokens["random"] == tokens["file"] != tokens["other"]


def test_bad_seed_file_is_a_load_error(tiny_llama, tmp_path):
    d = _random_dir(tiny_llama, tmp_path / "bad", seed=0)
    (d / RANDOM_WEIGHTS_FILE).write_text('{"seed": "zero"}')
    with pytest.raises(ModelLoadError, match="seed"):
        LLM(str(d))


def test_the_benchmark_presets_are_one_shape_of_about_50m_parameters():
    """#44's benchmark compares each family with Llama at the same dimensions: every `bench-*-56m`
    preset's checkpoint holds 50-60M parameters, in 8 layers of width 512, as its family."""
    import math

    from pdserve.engine.checkpoint import PRESETS, _config
    from pdserve.engine.models.loader import checkpoint_tensors

    bench = sorted(name for name in PRESETS if name.startswith("bench-") and name.endswith("-56m"))
    assert bench == ["bench-deepseek-v3-56m", "bench-gemma3-56m", "bench-llama-56m", "bench-phi3-56m",
                     "bench-qwen3-56m", "bench-qwen3-moe-56m"]
    for name in bench:
        arch = ModelArch.from_dict(_config(PRESETS[name], PRESETS[name].vocab_size, 0, 1))
        params = sum(math.prod(shape) for _, shape, _ in checkpoint_tensors(arch))
        assert 50e6 <= params <= 60e6, (name, params)
        assert (arch.model_type, arch.hidden_size, arch.num_layers) == (PRESETS[name].model_type, 512, 8)
