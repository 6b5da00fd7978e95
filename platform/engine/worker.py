"""A worker rank of a parallel engine: its shard of the model and its KV heads, running each step
the driver (rank 0) broadcasts until the driver stops the group. No scheduler, no sampling."""

from __future__ import annotations

import logging

import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.engine.engine import load_rank
from pdserve.engine.parallel import ParallelState, backend_for, init_group, receive_step
from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, init_method: str) -> None:
    init_group(rank, config.tensor_parallel_size, init_method, backend_for(config.device, config.distributed_backend))
    try:
        parallel = ParallelState(rank, config.tensor_parallel_size, config.enable_expert_parallel)
        model, _, kv_cache = load_rank(config, parallel)
        runner = ModelRunner(model, kv_cache, None, None, config.device, parallel)
        log.info("rank %d ready: %d KV blocks", rank, kv_cache.num_blocks)
        while (step := receive_step(runner.device)) is not None:
            runner.run_step(step)
    finally:
        dist.destroy_process_group()
