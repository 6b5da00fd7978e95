"""One rank of an engine: `load_rank` builds its model shard and KV cache (the driver, rank 0,
calls it too); a worker rank (`WorkerRank`, ranks 1..N-1) then runs each step the driver
broadcasts until the driver stops the group. No scheduler, no sampling. `spawn_local_workers`
starts the worker ranks as child processes where no Ray places them (`pdserve generate`, tests)."""

from __future__ import annotations

import logging
import multiprocessing as mp

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_groups import layer_groups, layer_slots
from pdserve.engine.models.arch import ModelArch, parse_dtype
from pdserve.engine.models.loader import load_model
from pdserve.engine.parallel import (SINGLE, ParallelState, backend_for, init_group, receive_step,
                                     torch_threads_per_rank)
from pdserve.engine.runner import ModelRunner
from pdserve.errors import ModelLoadError

log = logging.getLogger(__name__)


def load_rank(config: EngineConfig, parallel: ParallelState = SINGLE) -> tuple[torch.nn.Module, ModelArch, KVCache]:
    """This rank's model shard and KV cache (its KV heads; the same number of blocks on every rank)."""
    torch.set_num_threads(torch_threads_per_rank(config))
    dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
    weight_dtype = None if config.weight_dtype == "auto" else parse_dtype(config.weight_dtype)
    model, arch = load_model(config.model, dtype, config.device, config.max_model_len, parallel, weight_dtype)
    if (config.max_model_len or arch.context_len) > arch.context_len:
        raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the model's context length "
                             f"{arch.context_len}")
    kv_dtype = next(model.parameters()).dtype if config.kv_cache_dtype == "auto" else parse_dtype(config.kv_cache_dtype)
    # Several layer groups (Gemma 3's sliding and global layers): a block id is one group's block,
    # `num_slots` layers deep (kv_groups.py); one group: a block id spans every layer.
    groups = layer_groups(arch.num_layers, arch.layer_windows)
    slots, group_of = layer_slots(groups) if len(groups) > 1 else (None, None)
    # Multi-head latent attention (DeepSeek-V3) caches one latent vector per token and layer: the
    # latent layout, one "head" of its width, whole on every rank.
    heads, width = (1, arch.latent_dim) if arch.is_mla else (model.num_kv_heads, arch.head_dim)
    bytes_per_block = KVCache.bytes_per_block_for(len(groups[0].layers), config.block_size, heads, width, kv_dtype,
                                                  arch.is_mla)
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
    kv_cache = KVCache(arch.num_layers, num_blocks, config.block_size, heads, width, kv_dtype, config.device, slots,
                       group_of, is_latent=arch.is_mla)
    return model, arch, kv_cache


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


def _local_worker(config_json: str, rank: int, init_method: str) -> None:
    run_worker(EngineConfig.model_validate_json(config_json), rank, init_method)


def spawn_local_workers(config, init_method: str) -> list[mp.Process]:
    """Ranks 1..N-1 of `config` as child processes on this machine (rank 0 is the caller)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, config.tensor_parallel_size):
        p = ctx.Process(target=_local_worker, args=(config.model_dump_json(), rank, init_method),
                        name=f"pdserve-rank-{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs
