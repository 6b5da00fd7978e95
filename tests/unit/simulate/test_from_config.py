"""`pdserve simulate --config`: what it takes from a pdserve config."""

import pytest

from pdserve.simulate.from_config import read

CONFIG = """
model: /models/Meta-Llama-3-8B-Instruct
mode: disaggregated
slo: {ttft_ms: 1000, itl_ms: 50}
engine: {dtype: bfloat16, device: cuda, block_size: 32}
prefill:
  num_replicas: 2
  ray_actor_options: {num_gpus: 1, accelerator_type: H100}
  engine: {max_num_batched_tokens: 8192}
  autoscaling: {min_replicas: 1, max_replicas: 4}
decode:
  num_replicas: 3
  ray_actor_options: {num_gpus: 2, accelerator_type: A100-80G}
  engine: {tensor_parallel_size: 2, max_num_seqs: 128, max_num_batched_tokens: 512}
  autoscaling: {min_replicas: 1, max_replicas: 8, downscale_delay_s: 90}
"""


def test_the_pools_limits_slo_and_budget_come_from_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    dep = read(str(path))
    assert (dep.prefill_replicas, dep.decode_replicas, dep.prefill_tp, dep.decode_tp) == (2, 3, 1, 2)
    assert (dep.prefill_accelerator, dep.decode_accelerator) == ("H100", "A100")
    assert (dep.block_size, dep.max_num_batched_tokens, dep.max_num_seqs) == (32, 512, 128)
    assert dep.max_ongoing_requests == 128  # the pool's default: a whole batch
    assert dep.slo == (1000.0, 50.0, 99.0)
    # Both pools autoscale against the slo: one policy, within the pools' max_replicas together,
    # each pool within its own bounds, shrinking after the longer of their delays.
    assert dep.max_total_replicas == 12
    assert (dep.prefill_bounds, dep.decode_bounds, dep.downscale_delay_s) == ((1, 4), (1, 8), 90.0)


def test_a_colocated_config_has_no_prefill_pool_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: colocated\ndecode: {num_replicas: 2}\n")
    dep = read(str(path))
    assert (dep.prefill_replicas, dep.decode_replicas, dep.slo, dep.model) == (0, 2, None, None)
    assert (dep.max_total_replicas, dep.prefill_bounds, dep.decode_bounds) == (None, None, None)
    assert dep.decode_accelerator is None
    path.write_text("decode: {num_replicas: 0}\n")
    with pytest.raises(ValueError, match="num_replicas"):
        read(str(path))
