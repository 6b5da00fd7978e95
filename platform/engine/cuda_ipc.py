"""A GPU KV cache another process on this host can map (CUDA IPC): the GPU's counterpart of
`shared_memory.py`. A decode process on the prefill process's GPU then copies a prefill's blocks
straight out of the prefill's cache, one kernel from cache to cache, instead of receiving them
over the network backend (measured on an H100: a 128 MiB pull of 64 messages took 4.4 ms over
UCX's cuda_ipc transport, where the copy itself takes ~0.1 ms).

`share(kv)` describes the allocation holding a cache (`CudaRegion`: host, pid, the device's UUID,
the IPC handle torch's allocator gives for it and torch's reference counter for the consumers);
`open_region(region)` maps it in another process, or returns None where that cannot work: another
host, a device this process does not see (Ray gives each replica its own GPUs), an allocation
torch cannot share (expandable segments), or no CUDA here. Opening a handle costs a few hundred
microseconds: importers keep what they opened (`base._MAX_SOURCES`).

The handle is what torch's own CUDA tensor sharing sends (`torch.multiprocessing`), as plain
fields (hex strings and integers): a region is rebuilt from them, never unpickled. torch is
imported on use: the KV protocol names `CudaRegion` and stays torch-free.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.shared_memory import host_id

if TYPE_CHECKING:  # annotations only: the module stays torch-free at import
    import torch

log = logging.getLogger(__name__)

# torch names its reference counters' shared memory files like this (`THManagedMapAllocator`):
# a region naming anything else is refused before torch opens it.
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9A-Za-z_]{1,64}")


@dataclass(frozen=True)
class CudaRegion:
    host: str  # host_id() of the owner
    pid: int
    device_uuid: str  # the GPU, as every process names it whatever its CUDA_VISIBLE_DEVICES
    handle: str  # hex: cudaIpcMemHandle of the allocation holding the cache
    nbytes: int  # the cache's bytes
    offset: int  # where the cache starts in that allocation
    ref_counter: str  # hex: torch's reference counter file for consumers of this allocation
    ref_counter_offset: int
    event: str  # hex: cudaIpcEventHandle the producer recorded after the allocation's last write
    event_sync_required: bool

    @classmethod
    def from_dict(cls, d: dict) -> "CudaRegion":
        return cls(str(d["host"]), int(d["pid"]), str(d["device_uuid"]), str(d["handle"]), int(d["nbytes"]),
                   int(d["offset"]), str(d["ref_counter"]), int(d["ref_counter_offset"]), str(d["event"]),
                   bool(d["event_sync_required"]))


def is_gone(region: CudaRegion) -> bool:
    """Whether the process that shared `region` on this host has exited (another host's: False)."""
    return region.host == host_id() and not os.path.exists(f"/proc/{region.pid}")


def _uuid(device: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def share(kv: "torch.Tensor") -> CudaRegion | None:
    """`kv` (a whole CUDA tensor, contiguous) as a region other processes can open; None where
    torch cannot share its allocation."""
    if not kv.is_cuda or not kv.is_contiguous() or kv.storage_offset() != 0:
        return None
    try:
        device, handle, size, offset, counter, counter_offset, event, sync = kv.untyped_storage()._share_cuda_()
    except RuntimeError as e:  # e.g. expandable segments
        log.info("the KV cache cannot be shared over CUDA IPC (%s): its pulls go over the network", e)
        return None
    nbytes = kv.numel() * kv.element_size()
    if size < nbytes:
        return None
    return CudaRegion(host_id(), os.getpid(), _uuid(device), handle.hex(), nbytes, offset, counter.hex(),
                      counter_offset, (event or b"").hex(), bool(sync))


def open_region(region: CudaRegion, dtype, shape: tuple[int, ...], device) -> "torch.Tensor | None":
    """`region` mapped into this process as a tensor of `dtype` and `shape` (its bytes) on `device`,
    or None where it cannot be (see the module), also when the region is on another of this
    process's devices (the copy kernels read and write one device)."""
    import torch

    if region.host != host_id() or region.pid == os.getpid() or not torch.cuda.is_available():
        return None
    if math.prod(shape) * torch.empty((), dtype=dtype).element_size() != region.nbytes:
        return None
    device = torch.device(device).index or 0
    try:
        counter = bytes.fromhex(region.ref_counter)
        if _uuid(device) != region.device_uuid or not _REF_COUNTER_NAME.fullmatch(counter):
            return None
        storage = torch.UntypedStorage._new_shared_cuda(
            device, bytes.fromhex(region.handle), region.nbytes, region.offset, counter,
            region.ref_counter_offset, bytes.fromhex(region.event), region.event_sync_required)
    except (RuntimeError, ValueError) as e:  # the process is gone, or its GPU is not reachable from here
        log.info("cannot open the KV cache of process %d over CUDA IPC (%s): its pulls go over the network",
                 region.pid, e)
        return None
    return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(storage, 0, shape)
