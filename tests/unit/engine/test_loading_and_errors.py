"""Checkpoints: what loads, and the typed errors for what does not. (What transformers makes of them:
tests/integration/engine/test_parity_hf.py.)"""

import json
import shutil

import pytest
import torch

from pdserve.engine.checkpoint import make_checkpoint
from pdserve.engine.engine import LLMEngine
from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError, UnsupportedModelError


def test_checkpoints_are_deterministic(tmp_path):
    a = make_checkpoint("tiny-llama", tmp_path / "a", seed=3)
    b = make_checkpoint("tiny-llama", tmp_path / "b", seed=3)
    c = make_checkpoint("tiny-llama", tmp_path / "c", seed=4)
    read = lambda d: (d / "model.safetensors").read_bytes()
    assert read(a) == read(b) != read(c)
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


def test_bfloat16_dtype(tiny_llama):
    model, _ = load_model(tiny_llama, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    [out] = LLM(tiny_llama, dtype="bfloat16").generate(["paris"], SamplingParams(max_tokens=5, temperature=0))
    assert len(out.token_ids) == 5


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_and_broken_checkpoints(tiny_llama, tmp_path):
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(_edit_config(tiny_llama, tmp_path / "a", model_type="gpt2"))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(_edit_config(tiny_llama, tmp_path / "b", hidden_size=None))
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        load_model(_edit_config(tiny_llama, tmp_path / "c", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(_edit_config(tiny_llama, tmp_path / "d", intermediate_size=96))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        load_model(_edit_config(tiny_llama, tmp_path / "e", hidden_act="gelu"))
    no_weights = _edit_config(tiny_llama, tmp_path / "f")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(no_weights)
    corrupt = _edit_config(tiny_llama, tmp_path / "g")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(corrupt)
    bad_json = _edit_config(tiny_llama, tmp_path / "h")
    (bad_json / "config.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match="JSON"):
        load_model(bad_json)
    with pytest.raises(ModelLoadError, match="not a directory"):
        LLM(str(tmp_path / "missing"))


def test_transformers5_config_style_is_read():
    arch = ModelArch.from_dict({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}})
    assert arch.rope_theta == 1234.0 and arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.dtype == torch.bfloat16 and arch.num_kv_heads == 2


def test_request_errors(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, max_model_len=64, num_kv_blocks=8))
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="empty") as e:
        engine.add_request("a", [], params)
    assert e.value.param == "prompt"
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("b", list(range(5, 69)), params)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("c", [5, 100000], params)
    with pytest.raises(PromptTooLongError, match="KV blocks"):
        LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=2)).add_request("d", list(range(5, 45)), params)
    engine.add_request("e", [5, 6], params)
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("e", [5, 6], params)
    with pytest.raises(ModelLoadError, match="exceeds"):
        LLMEngine(EngineConfig(model=tiny_llama, max_model_len=10**6))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model=tiny_llama, max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model=tiny_llama, device="cuda:x")
