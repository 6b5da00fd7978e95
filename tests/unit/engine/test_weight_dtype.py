"""`weight_dtype: bfloat16` under an fp32 model: weight-only bf16. The weight matrices are rounded
to bf16 once at load and kept in half the bytes where the CPU kernels run; activations and sums
stay fp32. So the engine gives exactly what an fp32 checkpoint holding the rounded matrices gives,
on the kernels and on the torch path alike."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.models.loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ModelLoadError

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (1, 9, 17, 40)]


def _rounded_copy(checkpoint: str, out: Path) -> str:
    """The checkpoint with every weight matrix rounded to bf16, stored as fp32."""
    shutil.copytree(checkpoint, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({name: t.bfloat16().float() if t.dim() >= 2 else t for name, t in tensors.items()}, str(path))
    return str(out)


def _outputs(llm: LLM):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mixtral"])  # tied embeddings; experts
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_bf16_weights_give_exactly_the_rounded_checkpoints_outputs(checkpoints, tmp_path, preset, kernels,
                                                                    monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", kernels)
    bf16 = LLM(checkpoints[preset], block_size=4, weight_dtype="bfloat16")
    rounded = LLM(_rounded_copy(checkpoints[preset], tmp_path / "rounded"), block_size=4)
    packed = {m.packed.dtype for m in bf16.engine.model.modules() if getattr(m, "packed_for", None) == "pdserve"}
    if kernels == "auto":
        assert packed == {torch.bfloat16}  # every linear the kernels run is stored in bf16
    else:
        assert not packed
    assert _outputs(bf16) == _outputs(rounded)


def test_the_decode_step_streams_half_the_weight_bytes(tiny_llama):
    fp32, _ = load_model(tiny_llama)
    bf16, _ = load_model(tiny_llama, weight_dtype=torch.bfloat16)
    norms = sum(p.numel() * 4 for n, p in fp32.named_parameters() if "embed_tokens" not in n)  # fp32 still
    assert bf16.num_decode_weight_bytes() - norms == (fp32.num_decode_weight_bytes() - norms) // 2


def test_bf16_weights_stay_close_to_the_fp32_model(checkpoints):
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    fp32 = LLM(checkpoints["tiny-llama"]).generate(PROMPTS, params)
    bf16 = LLM(checkpoints["tiny-llama"], weight_dtype="bfloat16").generate(PROMPTS, params)
    for a, b in zip(fp32, bf16):  # the same ranking at the top, logprobs within ~2^-7 of their size
        top_a, top_b = a.logprobs[0].top[:3], b.logprobs[0].top[:3]
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert all(abs(x - y) < 0.05 * max(1.0, abs(x)) for (_, x), (_, y) in zip(top_a, top_b))  # 0.115 seen at -2.8


def test_weight_dtype_applies_to_fp32_models_only(tiny_llama):
    same, _ = load_model(tiny_llama, torch.bfloat16, weight_dtype=torch.bfloat16)  # already bf16: nothing to do
    assert next(same.parameters()).dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="weight_dtype .* applies to float32 models"):
        load_model(tiny_llama, torch.float16, weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineConfig(model=tiny_llama, weight_dtype="int8")
