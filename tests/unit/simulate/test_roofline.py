"""The roofline's step time against hand-computed cases, and the model spec's counts."""

import pytest

from pdserve.simulate.hardware import Accelerator
from pdserve.simulate.model import ModelSpec
from pdserve.simulate.roofline import StepCost, prefill_pairs
from tests.unit.simulate.fixtures import ACCELERATOR, MODEL


def test_a_decode_step_is_bound_by_the_bytes_it_streams():
    # 8 streams of 1,000 context tokens: 2e9 weight bytes + 8,000 x 65,536 KV bytes = 2.524288e9
    # bytes at 1e12 B/s = 2.524288 ms; 8 x 2e9 FLOPs + 8,000 x 4 x 32 x 32 x 128 FLOPs = 1.6e10 +
    # 2.62e8 at 1e14 = 0.16 ms: memory-bound. Plus 1 ms overhead.
    cost = StepCost(MODEL, ACCELERATOR)
    assert cost.seconds(8, 8000, 8000) == pytest.approx(1e-3 + 2.524288e-3, rel=1e-12)


def test_a_prefill_step_is_bound_by_its_flops():
    # 2,048 new tokens, no cache: 2,048 x 2e9 FLOPs + (2,048 x 2,049 / 2) pairs x 524,288 FLOPs
    # = 4.096e12 + 1.0999e12 at 1e14 = 51.96 ms; bytes: 2e9 + 2,048 x 65,536 = 2.134e9 -> 2.13 ms.
    cost = StepCost(MODEL, ACCELERATOR)
    pairs = prefill_pairs(0, 2048)
    assert pairs == 2048 * 2049 / 2
    flops = 2048 * 2e9 + pairs * 4 * 32 * 32 * 128
    assert cost.seconds(2048, 2048, pairs) == pytest.approx(1e-3 + flops / 1e14, rel=1e-12)


def test_tensor_parallel_splits_the_work_and_adds_the_all_reduces():
    cost = StepCost(MODEL, ACCELERATOR, tp=2)
    # Half the bytes per device; 2 all-reduces x 32 layers x 4,096 x 2 bytes x (2 x 1/2) per token.
    comm = 8 * 2 * 32 * 4096 * 2 * 1.0 / 1e11
    assert cost.seconds(8, 8000, 8000) == pytest.approx(1e-3 + 2.524288e-3 / 2 + comm, rel=1e-12)


def test_an_moe_step_streams_only_the_experts_its_tokens_pick():
    moe = ModelSpec(name="moe", num_layers=2, hidden_size=64, num_heads=4, head_dim=16, dense_params=1000,
                    num_moe_layers=2, num_experts=8, num_experts_per_tok=2, expert_params=100,
                    weight_bytes_per_param=1, kv_bytes_per_token=0)
    assert moe.num_params == 1000 + 2 * 8 * 100 and moe.num_active_params == 1000 + 2 * 2 * 100
    # One token touches its 2 experts a layer; many tokens touch nearly all 8.
    assert moe.weight_bytes_read(1) == pytest.approx(1000 + 2 * 2 * 100)
    assert moe.weight_bytes_read(1000) == pytest.approx(1000 + 2 * 8 * 100)
    cost = StepCost(moe, Accelerator("a", 1.0, 1e30, 1, 1, 1))
    assert cost.seconds(1, 0, 0) == pytest.approx(1400)


def test_public_config_counts():
    """Llama 3.1 8B has 8,030,261,248 parameters: the matrices counted here, the 128,256 x 4,096
    input embedding (a gather) and 65 norms of 4,096 (not counted); 32 layers x 8 KV heads x 128 x
    2 (K, V) x 2 bytes = 128 KiB of KV a token."""
    from pdserve.simulate.model import load_model

    spec = load_model("llama-3.1-8b")
    assert spec.num_params + 128256 * 4096 + 65 * 4096 == 8_030_261_248
    assert spec.kv_bytes_per_token == 131072
