"""Ray glue for a tensor-parallel replica (DESIGN.md section 3): the replica actor is rank 0 (the
engine's driver); ranks 1..N-1 are `RankWorker` actors in the replica's placement group (one
bundle per rank, PACK), joined into one torch.distributed group. The replica's health check
fails when any rank has stopped, so Ray Serve replaces the whole gang; rank workers are owned by
the replica actor and die with it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.parallel import free_init_method
from pdserve.kvtransfer.protocol import KVHandle, KVTransferError

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=4)  # `run` blocks for the engine's life; KV and pings answer beside it
class RankWorker:
    def __init__(self, config_json: str, rank: int, init_method: str, transfer_json: str | None = None,
                 host: str = "127.0.0.1"):
        self.config = EngineConfig.model_validate_json(config_json)
        self.rank, self.init_method, self.host = rank, init_method, host
        self.transfer = TransferConfig.model_validate_json(transfer_json) if transfer_json else None
        self.worker = None
        self._endpoints: dict[str, object] = {}
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        from pdserve.engine.worker import WorkerRank

        try:
            self.worker = WorkerRank(self.config, self.rank, self.init_method)
        finally:
            self._ready.set()
        self.worker.serve()

    def _endpoint(self, kind: str):
        """This rank's KV exporter (a prefill rank) or importer (a decode rank), opened on first
        use. It serves or pulls its own heads; the driver owns the leases' pins (block ids are the
        same on every rank), so this exporter pins nothing."""
        from pdserve.kvtransfer.backends import BACKENDS, exporter_options, layout_of

        self._ready.wait()
        with self._lock:
            if kind not in self._endpoints:
                kv = self.worker.kv_cache.kv
                exporter_cls, importer_cls = BACKENDS[self.transfer.backend]()
                layout = layout_of(kv, Path(self.config.model).name, self.config.tensor_parallel_size, self.rank)
                if kind == "importer":
                    self._endpoints[kind] = importer_cls(kv, layout)
                else:
                    # A little shorter than the driver's lease, so a read never outlives the driver's pin.
                    options = exporter_options(self.transfer.backend, self.host, self.transfer.shared_memory)
                    self._endpoints[kind] = exporter_cls(
                        f"{self.init_method}#rank{self.rank}", kv, layout, lambda ids: None, lambda ids: None,
                        lease_s=max(1.0, self.transfer.lease_s - 2.0), **options)
            return self._endpoints[kind]

    def export(self, request_id: str, block_ids: list[int], num_tokens: int) -> dict:
        return self._endpoint("exporter").export(request_id, block_ids, num_tokens).to_dict()

    def pull(self, handle: dict, dst: list[int], first_block: int, timeout_s: float) -> None:
        """Pull this rank's heads into `dst`; the lease stays for the driver to release."""
        self._endpoint("importer").pull(KVHandle.from_dict(handle), dst, timeout_s, None, first_block, ack=False)

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

    def __init__(self, config: EngineConfig, transfer: TransferConfig | None = None, host: str = "127.0.0.1"):
        """`transfer`: open KV endpoints on every rank (a disaggregated pool), advertised at `host`."""
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
                name=None).remote(config.model_dump_json(), rank, self.init_method,
                                  transfer and transfer.model_dump_json(), host)
            for rank in range(1, config.tensor_parallel_size)]
        self.runs = [w.run.remote() for w in self.workers]

    def check(self, timeout_s: float = 10.0) -> list[dict]:
        """Each worker rank's {rank, pid, node_id}; raises when a rank has stopped or does not answer."""
        finished, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if finished:
            raise RuntimeError(f"{len(finished)} rank worker(s) of this replica stopped")
        return ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    async def export(self, request_id: str, block_ids: list[int], num_tokens: int) -> tuple[KVHandle, ...]:
        """Lease handles of ranks 1..N-1 for a request's blocks (rank 0's comes from the driver)."""
        dicts = await asyncio.gather(*(w.export.remote(request_id, block_ids, num_tokens) for w in self.workers))
        return tuple(KVHandle.from_dict(d) for d in dicts)

    async def pull(self, rank: int, handle: KVHandle, dst: list[int], first_block: int, timeout_s: float) -> None:
        try:
            await self.workers[rank - 1].pull.remote(handle.to_dict(), dst, first_block, timeout_s)
        except ray.exceptions.RayTaskError as e:  # the worker's typed error, unwrapped
            raise e.cause if isinstance(e.cause, KVTransferError) else KVTransferError(str(e)) from None
        except ray.exceptions.RayActorError as e:
            raise KVTransferError(f"rank {rank} of this replica is gone: {e}") from None

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)
