"""Ray glue for a tensor-parallel replica (DESIGN.md section 3): the replica actor is rank 0 (the
engine's driver); ranks 1..N-1 are `RankWorker` actors in the replica's placement group (one
bundle per rank, PACK), joined into one torch.distributed group. The replica's health check
fails when any rank has stopped, so Ray Serve replaces the whole gang; rank workers are owned by
the replica actor and die with it."""

from __future__ import annotations

import logging
import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import EngineConfig
from pdserve.engine.parallel import free_init_method

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=2)  # `run` blocks for the engine's life; `ping` answers beside it
class RankWorker:
    def __init__(self, config_json: str, rank: int, init_method: str):
        self.config_json, self.rank, self.init_method = config_json, rank, init_method

    def run(self) -> None:
        from pdserve.engine.worker import run_worker

        run_worker(EngineConfig.model_validate_json(self.config_json), self.rank, self.init_method)

    def ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


def rank_bundles(ray_actor_options: dict, num_ranks: int) -> list[dict]:
    """One placement-group bundle per rank, each with what a replica actor asks for."""
    bundle = {"CPU": ray_actor_options.get("num_cpus", 1)}
    if ray_actor_options.get("num_gpus"):
        bundle["GPU"] = ray_actor_options["num_gpus"]
    bundle.update(ray_actor_options.get("resources") or {})
    if ray_actor_options.get("accelerator_type"):
        bundle[f"accelerator_type:{ray_actor_options['accelerator_type']}"] = 0.001
    return [dict(bundle) for _ in range(num_ranks)]


class RankWorkers:
    """Ranks 1..N-1 of this replica's engine; pass `init_method` to `LLMEngine`."""

    def __init__(self, config: EngineConfig):
        self.init_method = free_init_method(ray.util.get_node_ip_address())
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("a tensor-parallel replica needs its placement group (pdserve.app sets "
                               "placement_group_bundles for pools whose tensor_parallel_size > 1)")
        bundle = pg.bundle_specs[0]
        self.workers = [
            RankWorker.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                name=None).remote(config.model_dump_json(), rank, self.init_method)
            for rank in range(1, config.tensor_parallel_size)]
        self.runs = [w.run.remote() for w in self.workers]

    def check(self, timeout_s: float = 10.0) -> list[dict]:
        """Each worker rank's {rank, pid, node_id}; raises when a rank has stopped or does not answer."""
        finished, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if finished:
            raise RuntimeError(f"{len(finished)} rank worker(s) of this replica stopped")
        return ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)
