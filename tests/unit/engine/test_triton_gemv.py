"""The one-token GEMV (`triton_gemv`) against torch, on fresh random inputs every run: under the
Triton interpreter on CPU, natively on a GPU when there is one. Then a model's one-token steps on
it (`DecoderLayer._forward_gemvs`) against the op-by-op forward pass: the same tokens.

Tolerances: the kernel keeps the normalised input, the SwiGLU product and the sums in fp32 where
the torch reference rounds each to the dtype, so bf16 and fp16 get a few of the dtype's steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # as test_triton_fused.py: interpreted on a machine without a GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.kernels import cpu_decoder, ops, paged_attention  # noqa: E402
from pdserve.engine.kernels import triton_gemv as tg  # noqa: E402
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.models.llama import DecoderLayer  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not tg.HAS_TRITON, reason="needs triton")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


# Rows and columns that are not multiples of any tile, one of each tiling's block.
SHAPES = [(37, 100), (16, 512), (130, 1030)]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_is_the_matrix_vector_product(n, k, dtype):
    x, w = _rand(k, dtype=dtype), _rand(n, k, dtype=dtype, scale=k ** -0.5)
    _close(tg.gemv(x, w), F.linear(x.float()[None], w.float())[0].to(dtype), dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("n,k", SHAPES)
def test_norm_is_read_in(n, k, dtype):
    x, w = _rand(1, k, dtype=dtype, scale=3.0), _rand(n, k, dtype=dtype, scale=k ** -0.5)
    norm_w = 1 + _rand(k, dtype=dtype, scale=0.1)
    expected = F.linear(ops._rms_norm_torch(x.float(), norm_w.float(), 1e-5), w.float()).to(dtype)
    _close(tg.gemv(x[0], w, norm=(norm_w, 1e-5))[None], expected, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("n,k", SHAPES)
def test_swiglu_is_read_in_and_the_product_added_to_the_residual(n, k, dtype):
    gate_up, w = _rand(2 * k, dtype=dtype), _rand(n, k, dtype=dtype, scale=k ** -0.5)
    residual = _rand(n, dtype=dtype)
    expected = (residual.float() + F.linear(ops._silu_mul_torch(gate_up.float()[None]), w.float())[0]).to(dtype)
    out = residual.clone()
    assert tg.gemv(gate_up, w, swiglu=True, out=out, residual=True) is out
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("heads,kv_heads,head_dim,hidden", [(4, 2, 16, 100), (8, 8, 64, 512), (6, 2, 128, 300)])
def test_qkv_gemv_rotates_q_and_k_and_writes_k_and_v_to_their_slot(heads, kv_heads, head_dim, hidden, dtype):
    rows = (heads + 2 * kv_heads) * head_dim
    x, w = _rand(1, hidden, dtype=dtype, scale=2.0), _rand(rows, hidden, dtype=dtype, scale=hidden ** -0.5)
    norm_w = 1 + _rand(hidden, dtype=dtype, scale=0.1)
    angle = torch.rand(1, head_dim // 2, device=DEVICE) * 6.3
    cos_sin = torch.stack((angle.cos(), angle.sin()), dim=1)  # [1, 2, head_dim // 2], fp32
    caches = [_rand(5, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]  # ours K, V; the reference's K, V
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    slot = torch.tensor([37], device=DEVICE)  # block 2, position 5

    got = tg.qkv_gemv(x[0], w, (norm_w, 1e-5), cos_sin[0], heads, caches[0], caches[1], slot)
    # The reference in fp32 (the kernel rounds once, at its stores), then rounded.
    ref = F.linear(ops._rms_norm_torch(x.float(), norm_w.float(), 1e-5), w.float()).view(1, -1, head_dim)
    ops._rotary_torch(ref[:, :heads + kv_heads], cos_sin)
    _close(got, ref.reshape(-1).to(dtype), dtype)
    ref_k, ref_v = ref[:, heads:heads + kv_heads].to(dtype), ref[:, heads + kv_heads:].to(dtype)
    paged_attention.write_kv(ref_k, ref_v, caches[2], caches[3], slot)
    for ours, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        _close(ours, theirs, dtype)
        flat_ours, flat_theirs = ours.view(-1, kv_heads, head_dim), theirs.view(-1, kv_heads, head_dim)
        assert torch.equal(torch.cat((flat_ours[:37], flat_ours[38:])), torch.cat((flat_theirs[:37], flat_theirs[38:])))


def test_every_tiling_of_the_benchmark_gives_the_same_product():
    x, w = _rand(300), _rand(70, 300, scale=300 ** -0.5)
    expected = F.linear(x[None], w)[0]
    for tile in ((8, 512, 4, 3), (16, 256, 4, 3), (32, 256, 8, 3), (4, 64, 1, 1)):
        _close(tg.gemv(x, w, tile=tile), expected, torch.float32)


def test_tiling_keeps_two_programs_an_sm():
    sms = tg._num_sms(torch.device(DEVICE))
    wide_rows = 2 * sms * 16
    assert tg.tiling(wide_rows, 4096, torch.device(DEVICE))[0] == 16
    assert tg.tiling(wide_rows - 16, 4096, torch.device(DEVICE))[0] == 8


def test_a_residual_needs_its_output():
    with pytest.raises(ValueError, match="out"):
        tg.gemv(_rand(8), _rand(4, 8), residual=True)


def test_ops_take_the_gemvs_only_for_one_token_on_a_gpu():
    w = _rand(8, 16)
    assert not ops.runs_gemvs(_rand(2, 16).to(DEVICE), w)  # two tokens
    assert ops.runs_gemvs(_rand(1, 16), w) == (DEVICE == "cuda")
    assert not ops.runs_gemvs(_rand(1, 16), w, None)  # a weight packed away (the CPU's C matmul)
    assert not ops.runs_gemvs(_rand(1, 16), w.t())  # columns contiguous
    assert not ops.runs_gemvs(_rand(1, 16, dtype=torch.bfloat16), w)  # another dtype


def _generate(model_dir: str):
    return _generate_with(LLM(model_dir, max_num_seqs=1))


def _generate_with(llm: LLM):
    prompts = [list(range(3, 3 + n)) for n in (1, 7, 19)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton compiled for a GPU takes no CPU tensors: the GPU test "
                                                     "below runs this path natively")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_one_token_steps_on_the_gemvs_give_the_op_by_op_tokens(checkpoints, preset, monkeypatch):
    # On a CPU the layers take the GEMV path only when told to: `runs_gemvs` patched, and the
    # kernel chosen as on a GPU, so that it runs under the interpreter. On both sides the weights
    # stay unpacked, as on a GPU, and the C decoder is off, so both run the model's forward pass.
    # Batches of one: every decode step is one token. tiny-qwen2 has qkv biases: its layers must
    # keep to the op-by-op path.
    monkeypatch.setattr(ops, "packs_linear_for_c", lambda weight: False)
    monkeypatch.setattr(ops, "pack_linear", lambda weight, packed_out=None: (None, None))
    monkeypatch.setattr(cpu_decoder, "decoder_for", lambda model, kv: None)
    reference = _generate(checkpoints[preset])
    taken = []
    runs = DecoderLayer._runs_gemvs

    def counted(layer, h):
        taken.append(runs(layer, h))
        return taken[-1]

    monkeypatch.setattr(ops, "runs_gemvs", lambda x, *weights: x.shape[0] == 1 and None not in weights)
    monkeypatch.setattr(ops, "_on_gpu", lambda t: True)  # for norm_gemv and gemv_add_: C kernels come first elsewhere
    monkeypatch.setattr(DecoderLayer, "_runs_gemvs", counted)
    got = _generate(checkpoints[preset])
    assert any(taken) == (preset == "tiny-llama") and not all(taken)  # prefills of several tokens stay op by op
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in reference]
    for (_, lp_got), (_, lp_ref) in zip(got, reference):
        assert lp_got == pytest.approx(lp_ref, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_one_token_steps_on_the_gemvs_give_the_op_by_op_tokens(checkpoints, monkeypatch):
    # Batch-1 decode steps replayed in the engine's CUDA graph, captured with the GEMV path and
    # without it, in fp32 (bf16's rounding is the kernel tests' and gpu_suite.py's).
    def generate():
        llm = LLM(checkpoints["tiny-llama"], device="cuda:0", dtype="float32", max_num_seqs=1)
        assert sorted(llm.engine.runner.decode_graphs._graphs) == [1]
        return _generate_with(llm)

    on_gemvs = generate()
    monkeypatch.setattr(ops, "runs_gemvs", lambda *args: False)
    op_by_op = generate()
    assert [tokens for tokens, _ in on_gemvs] == [tokens for tokens, _ in op_by_op]
    for (_, lp_got), (_, lp_ref) in zip(on_gemvs, op_by_op):
        assert lp_got == pytest.approx(lp_ref, abs=1e-4)
