"""A small model and accelerator for the simulator's tests: plain numbers, no checkpoint, no torch."""

from pdserve.autoscale.joint import Slo
from pdserve.simulate.hardware import Accelerator
from pdserve.simulate.model import ModelSpec
from pdserve.simulate.sim import AutoscaleSpec, PoolSpec, SimConfig

# 1e9 weights of 2 bytes, 32 layers of 32 heads of 128, 64 KiB of KV a token.
MODEL = ModelSpec(name="test-1b", num_layers=32, hidden_size=4096, num_heads=32, head_dim=128,
                  dense_params=1_000_000_000, num_moe_layers=0, num_experts=0, num_experts_per_tok=0,
                  expert_params=0, weight_bytes_per_param=2, kv_bytes_per_token=65536)
# 1 TB/s, 100 TFLOP/s, a 10 GB/s link, 1 ms a step, 1 GiB of KV cache (16,384 tokens: 1,024 blocks).
ACCELERATOR = Accelerator("test", 1e12, 1e14, 1e10, 1e11, 8e9, step_overhead_s=1e-3, kv_cache_bytes=2**30)


def config(prefill: int = 2, decode: int = 3, autoscale: AutoscaleSpec | None = None, seed: int = 0,
           ttft_s: float = 1.0, itl_s: float = 0.05, split: bool = True) -> SimConfig:
    return SimConfig(model=MODEL, decode=PoolSpec(ACCELERATOR, decode),
                     prefill=PoolSpec(ACCELERATOR, prefill) if prefill else None, slo=Slo(ttft_s, itl_s, 99.0),
                     max_num_batched_tokens=1024, max_num_seqs=64, seed=seed, autoscale=autoscale,
                     split_prompts_to_fill_steps=split)
