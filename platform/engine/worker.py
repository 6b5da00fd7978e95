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


class WorkerRank:
    """Joins the driver's group and loads this rank's shard; `serve()` runs steps until STOP.
    `kv_cache` is this rank's cache, for the KV transfer endpoints a disaggregated replica adds."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str):
        init_group(rank, config.tensor_parallel_size, init_method,
                   backend_for(config.device, config.distributed_backend))
        try:
            self.parallel = ParallelState(rank, config.tensor_parallel_size, config.enable_expert_parallel)
            model, _, self.kv_cache = load_rank(config, self.parallel)
            self.runner = ModelRunner(model, self.kv_cache, None, None, config.device, self.parallel)
        except BaseException:
            dist.destroy_process_group()
            raise
        log.info("rank %d ready: %d KV blocks", rank, self.kv_cache.num_blocks)

    def serve(self) -> None:
        try:
            while (step := receive_step(self.runner.device)) is not None:
                self.runner.run_step(step)
        finally:
            dist.destroy_process_group()


def run_worker(config: EngineConfig, rank: int, init_method: str) -> None:
    WorkerRank(config, rank, init_method).serve()
