"""The fused MoE kernels against the loop over experts in `MixtralMoE` (the reference), on fresh
random inputs every run: under the Triton interpreter on CPU (small shapes), natively on a GPU
when there is one. Hidden 32 and intermediate 48 are not multiples of the tiles: masks cover them."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter or compiled mode once per process: interpret on a machine without a
# GPU, compile for the GPU where there is one (then these run on cuda only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pdserve.engine.kernels import triton_moe as tm  # noqa: E402
from pdserve.engine.models.loader import load_model  # noqa: E402
from pdserve.engine.models.mixtral import MixtralMoE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 32, 48


def routing(num_tokens: int, num_experts: int, top_k: int, dtype=torch.float32, device=DEVICE):
    """Distinct random experts per token, and weights summing to 1 per token."""
    top_i = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(device)
    top_w = torch.rand(num_tokens, top_k, device=device) + 0.1
    return (top_w / top_w.sum(-1, keepdim=True)).to(dtype), top_i


def experts(num_experts: int, dtype, device=DEVICE):
    """`w13 [E, 2*I, H]`, `w2 [E, H, I]`: the checkpoint's layout, which the fused path keeps."""
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, device=device) / HIDDEN ** 0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, device=device) / INTER ** 0.5
    return w13.to(dtype), w2.to(dtype)


def reference(x, w13, w2, top_w, top_i) -> torch.Tensor:
    """`MixtralMoE`'s loop over experts, on the CPU (on a GPU `finalize` would choose the fused path)."""
    num_experts, two_i, hidden = w13.shape
    moe = MixtralMoE(hidden, two_i // 2, num_experts, top_i.shape[1])
    moe.w13.data, moe.w2.data = w13.cpu(), w2.cpu()
    moe.finalize()
    assert not moe.is_fused
    moe._route = lambda _: (top_w.cpu(), top_i.cpu())
    return moe(x.cpu()).to(x.device)


CASES = [  # (tokens, experts, top_k): most experts empty at one token; several blocks of one expert at 17
    (1, 4, 1), (1, 8, 2), (3, 4, 2), (3, 8, 1), (17, 4, 2), (17, 8, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
def test_fused_moe_matches_the_loop(dtype, num_tokens, num_experts, top_k):
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = experts(num_experts, dtype)
    top_w, top_i = routing(num_tokens, num_experts, top_k, dtype)
    got = tm.fused_moe(x, w13, w2, top_w, top_i)
    expected = reference(x, w13, w2, top_w, top_i)
    assert got.shape == x.shape and got.dtype == dtype
    # bf16: the loop rounds gate, up, each expert's output and each partial sum; the kernels round once.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def assert_fp32_matches_the_loop(num_tokens: int, num_experts: int, top_k: int, **tiles) -> None:
    """`fused_moe` at the given tiles (`block_m`, `block_n`) against the loop, in fp32."""
    top_w, top_i = routing(num_tokens, num_experts, top_k)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    w13, w2 = experts(num_experts, torch.float32)
    got = tm.fused_moe(x, w13, w2, top_w, top_i, **tiles)
    torch.testing.assert_close(got, reference(x, w13, w2, top_w, top_i), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_every_token_on_every_expert(block_m):
    """Top-4 of 4 experts: each expert gets all 17 tokens, a run over two blocks of 16 (or most
    of one block of 64)."""
    assert_fp32_matches_the_loop(17, 4, 4, block_m=block_m)


@pytest.mark.parametrize("block_n", [16, 32])
def test_narrower_output_tiles_give_the_same_result(block_n):
    """The tiles a decode batch gets where 64-wide ones would leave SMs idle (`choose_block_n`)."""
    assert_fp32_matches_the_loop(3, 8, 2, block_n=block_n)


def test_block_n_fills_the_sms_at_decode_batches_only():
    # Qwen3-30B-A3B on 132 SMs: batch 1 (8 pairs) takes narrower tiles, batch 64 (512 pairs) 64.
    assert tm.choose_block_n(768, 8, 128, 132) == 16  # gate/up: 48 x 8 = 384 programs
    assert tm.choose_block_n(2048, 8, 128, 132) == 32  # down: 64 x 8 = 512
    assert tm.choose_block_n(768, 512, 128, 132) == 64
    assert tm.choose_block_n(2048, 512, 128, 132) == 64
    assert tm.choose_block_n(8, 1, 4, 132) == 16  # never under 16, nor over the outputs' power of two
    assert tm.choose_block_n(32, 64, 8, 1) == 32


@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (17, 8, 2, 16), (40, 4, 2, 16),
                                                                  (9, 5, 3, 32)])
def test_alignment_invariants(use_torch, num_tokens, num_experts, top_k, block_m):
    _, top_i = routing(num_tokens, num_experts, top_k)
    if num_tokens > 1:
        top_i[:, 0] = 1  # one expert over several blocks
    sorted_ids, block_expert, num_rows = tm.align_by_expert(top_i, num_experts, block_m, use_torch=use_torch)
    num_pairs = top_i.numel()
    counts = torch.bincount(top_i.flatten().cpu(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert sorted_ids.shape == (tm.num_aligned_rows(num_pairs, num_experts, block_m),)
    assert block_expert.shape == (sorted_ids.numel() // block_m,)
    assert num_rows.tolist() == [padded.sum().item()]
    assert sorted_ids.numel() >= num_rows.item()

    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    real = sorted_ids < num_pairs
    assert (sorted_ids[~real] == num_pairs).all()  # padding: the sentinel, nothing else
    assert sorted(sorted_ids[real].tolist()) == list(range(num_pairs))  # every pair once
    assert not real[num_rows.item():].any()
    flat = top_i.flatten().cpu()
    row = 0
    for expert in range(num_experts):  # runs in expert order, each padded to whole blocks of its expert
        run = sorted_ids[row:row + padded[expert]]
        assert run[:counts[expert]].tolist() == (flat == expert).nonzero().flatten().tolist()  # stable order
        assert (block_expert[row // block_m:(row + padded[expert]) // block_m] == expert).all()
        row += padded[expert].item()


def test_alignment_paths_agree():
    _, top_i = routing(33, 8, 2)
    one_program = tm.align_by_expert(top_i, 8, 16, use_torch=False)
    torch_ops = tm.align_by_expert(top_i, 8, 16, use_torch=True)
    for a, b in zip(one_program, torch_ops):
        assert torch.equal(a, b)


def test_forward_runs_the_fused_path_with_the_checkpoint_layout():
    """`MixtralMoE.forward` with `is_fused` (as `finalize` sets it on a GPU with Triton) routes on
    the device and gives the loop's output."""
    num_experts, top_k = 4, 2
    moe = MixtralMoE(HIDDEN, INTER, num_experts, top_k).to(DEVICE)
    w13, w2 = experts(num_experts, torch.float32)
    moe.w13.data, moe.w2.data = w13, w2
    moe.gate.weight.data.normal_()
    moe.is_fused = True  # the layout stays the checkpoint's
    x = torch.randn(5, HIDDEN, device=DEVICE)
    top_w, top_i = moe._route(x)
    torch.testing.assert_close(moe(x), reference(x, w13, w2, top_w, top_i), atol=2e-5, rtol=2e-5)


def test_cuda_graphs_need_the_fused_path_in_every_layer(checkpoints):
    model, _ = load_model(checkpoints["tiny-mixtral"], device=DEVICE)
    layers = [m for m in model.modules() if isinstance(m, MixtralMoE)]
    assert all(m.is_fused == (DEVICE == "cuda") for m in layers)
    assert model.supports_cuda_graphs == (DEVICE == "cuda")
    layers[0].is_fused = False
    assert not model.supports_cuda_graphs
