"""Tensor- and expert-parallel groups inside one replica (DESIGN.md sections 1 and 3).

A replica of degree N runs N ranks, one process each, in one torch.distributed group: NCCL on
CUDA (RCCL on ROCm builds of torch, which present their GPUs as CUDA devices), gloo on CPU.
Rank 0 (the driver) owns the scheduler and the KV block tables; every step it broadcasts the
step's inputs and all ranks run the forward pass together, each with its shard of the weights and
its KV heads. Workers (`worker.py`) sit in `run_worker` until the driver broadcasts STOP.

The step message is two tensor broadcasts (a fixed int64 header, then one int64 body), no pickle.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_STOP, _STEP = 0, 1
_HEADER = 9


@dataclass(frozen=True)
class ParallelState:
    """This process's place in its replica's group."""
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts spread over the ranks (else each expert is TP-split)


SINGLE = ParallelState()


def backend_for(device: str, forced: str = "auto") -> str:
    if forced != "auto":
        return forced
    return "nccl" if str(device).startswith("cuda") else "gloo"


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def init_group(rank: int, size: int, init_method: str, backend: str, join_timeout_s: float = 120.0) -> None:
    """Join the replica's group (every rank calls this with the same `tcp://host:port`).

    Joining gives up after `join_timeout_s` (a rank that never starts). Collectives get no
    practical timeout: a worker waits in `receive_step` for as long as the driver is idle. A dead
    rank is found by the driver's liveness checks (local processes) or the replica's health check
    (Ray rank workers), not by a collective timing out."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one parallel "
                           "replica per process")
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, rank == 0, timeout=timedelta(seconds=join_timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(days=7))
    log.info("rank %d/%d joined its %s group", rank, size, backend)


# ---- the step message

@dataclass
class GroupInputs:
    """A layer group's own slots and block tables past the first group's (kv_groups.py): the same
    shapes as `StepInputs`' (every group's tables have the same logical length)."""
    slot_mapping: torch.Tensor
    decode_tables: torch.Tensor | None
    prefill_tables: list[torch.Tensor]


@dataclass
class StepInputs:
    """What every rank needs to run one forward pass (the driver builds it from its scheduler)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_lens: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (query_start, query_len, context_len, table)
    logit_rows: torch.Tensor  # hidden rows whose logits the step needs: prompt-logprob rows, then samples
    num_prompt_rows: int = 0
    groups: list[GroupInputs] = field(default_factory=list)  # layer groups 1.. (a model with several)


def broadcast_step(step: StepInputs | None, device: torch.device) -> None:
    """Driver side: send the step (None: STOP) to every worker."""
    header = torch.zeros(_HEADER, dtype=torch.long)
    if step is None:
        header[0] = _STOP
        dist.broadcast(header.to(device), src=0)
        return
    nd = 0 if step.decode_tables is None else step.decode_tables.shape[0]
    max_blocks = 0 if step.decode_tables is None else step.decode_tables.shape[1]
    parts = [step.input_ids, step.positions, step.slot_mapping]
    if nd:
        parts += [step.decode_tables.flatten(), step.decode_lens]
    prefill_meta = [v for start, q_len, context_len, table in step.prefills
                    for v in (start, q_len, context_len, table.numel())]
    parts += [torch.tensor(prefill_meta, dtype=torch.long, device=step.input_ids.device)]
    parts += [table for *_, table in step.prefills] + [step.logit_rows]
    for g in step.groups:
        parts += [g.slot_mapping] + ([g.decode_tables.flatten()] if nd else []) + g.prefill_tables
    body = torch.cat([p.to(device) for p in parts])
    header[:] = torch.tensor([_STEP, step.input_ids.numel(), nd, max_blocks, len(step.prefills),
                              step.logit_rows.numel(), body.numel(), step.num_prompt_rows, len(step.groups)])
    dist.broadcast(header.to(device), src=0)
    dist.broadcast(body, src=0)


def receive_step(device: torch.device) -> StepInputs | None:
    """Worker side: the next step, or None when the driver stops the group."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    op, n, nd, max_blocks, np_, nrows, size, nprompt, ngroups = header.tolist()
    if op == _STOP:
        return None
    body = torch.empty(size, dtype=torch.long, device=device)
    dist.broadcast(body, src=0)
    at = 0

    def take(count: int) -> torch.Tensor:
        nonlocal at
        at += count
        return body[at - count:at]

    input_ids, positions, slots = take(n), take(n), take(n)
    tables = take(nd * max_blocks).view(nd, max_blocks) if nd else None
    lens = take(nd) if nd else None
    meta = take(4 * np_).view(np_, 4).tolist()
    prefills = [(s, q, c, take(k)) for s, q, c, k in meta]
    rows = take(nrows)
    groups = [GroupInputs(take(n), take(nd * max_blocks).view(nd, max_blocks) if nd else None,
                          [take(k) for *_, k in meta]) for _ in range(ngroups)]
    return StepInputs(input_ids, positions, slots, tables, lens, prefills, rows, nprompt, groups)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, which taskset, a container's cpuset or
    the parent that started it may have narrowed below the machine's count (`os.cpu_count()`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def torch_threads_per_rank(config) -> int:
    """Threads for each of a replica's ranks unless the config says otherwise: torch's default
    (OMP_NUM_THREADS, which Ray sets to an actor's num_cpus, else every core of the machine) held
    to the CPUs this process may run on, split evenly by the ranks. Without the cap, a process
    pinned to one of two cores runs two threads on it, and each step waits on the one descheduled."""
    if config.num_threads:
        return config.num_threads
    return max(1, min(torch.get_num_threads(), usable_cpus()) // config.tensor_parallel_size)
