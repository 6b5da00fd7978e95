"""Tensors another process on this host can map: a CPU KV cache lives in one, so a decode replica on
the same host copies a prefill replica's blocks straight out of its cache (the KV transfer's local
path) instead of receiving them through a socket.

`shared_zeros(shape, dtype)` allocates a zero-filled tensor in a memfd, every page taken at once:
anonymous shared memory, returned to the system with its last mapping, so a process that dies
leaves no file behind.
Once the owner has mapped the memfd, it seals it (`F_SEAL_FUTURE_WRITE`, with growing and
shrinking): its own mapping stays writable, but no process, of the same user or not, can map it
writable or write to it any more; importers only ever read it.
`locate(tensor)` describes the region holding a tensor so another process can find it
(`SharedRegion`: host, pid, fd, file identity, size); `map_region` maps it read-only there through
`/proc/<pid>/fd/<fd>`, or returns None where that cannot work: another host or container, the
process gone (its fd number then names nothing, or another file), no permission.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the module stays torch-free at import
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRegion:
    host: str  # host_id() of the owner: a region is only looked for on the same host
    pid: int
    fd: int
    file_id: tuple[int, int]  # (st_dev, st_ino) of the memfd: a reused pid or fd number names another file
    nbytes: int

    @classmethod
    def from_dict(cls, d: dict) -> "SharedRegion":
        return cls(str(d["host"]), int(d["pid"]), int(d["fd"]), tuple(int(x) for x in d["file_id"]), int(d["nbytes"]))


@lru_cache(maxsize=1)
def host_id() -> str:
    """This host (or container): its hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


# fcntl's sealing constants (Linux >= 5.1 for F_SEAL_FUTURE_WRITE); Python's fcntl module names
# them only from 3.8/3.9 on and not F_SEAL_FUTURE_WRITE everywhere.
_F_ADD_SEALS, _F_GET_SEALS = 1033, 1034
_F_SEAL_SHRINK, _F_SEAL_GROW, _F_SEAL_FUTURE_WRITE = 0x0002, 0x0004, 0x0010
SEALS = _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_FUTURE_WRITE

_regions: dict[int, SharedRegion] = {}  # address of a shared tensor's first byte -> its region
_regions_lock = threading.Lock()


def shared_zeros(shape: tuple[int, ...], dtype) -> "torch.Tensor":
    """A zero-filled CPU tensor in shared memory (`locate` finds it); a private one where memfds are
    missing (not Linux) or fail. Memfds do not live in /dev/shm, so its size does not limit them."""
    import torch

    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(os, "memfd_create"):
        return torch.zeros(shape, dtype=dtype)
    fd = -1
    try:
        fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        fcntl.fcntl(fd, _F_ADD_SEALS, SEALS)  # after our own writable mapping: no one else gets one
        st = os.fstat(fd)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        log.warning("no shared memory for the KV cache (%s): KV transfers on this host go through UCX", e)
        return torch.zeros(shape, dtype=dtype)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)  # keeps `mapping` alive
    # Take every page now. Left to fault in, each page's first write cost a kernel zeroing (~0.5 ms
    # per MiB on a 2-core VM) in whatever wrote it first: an engine step, a prefill, a KV pull. The
    # memory is held from the start, as a GPU engine's cache is (and as torch.zeros held it).
    tensor.view(torch.uint8).zero_()
    address = tensor.data_ptr()
    with _regions_lock:
        _regions[address] = SharedRegion(host_id(), os.getpid(), fd, (st.st_dev, st.st_ino), nbytes)
    weakref.finalize(mapping, _forget, address, fd)  # when the last view of the tensor is gone
    return tensor


def _forget(address: int, fd: int) -> None:
    with _regions_lock:
        _regions.pop(address, None)
    os.close(fd)


def locate(tensor) -> SharedRegion | None:
    """The region `tensor` is, when `shared_zeros` made it (the whole tensor, not a view into it)."""
    with _regions_lock:
        region = _regions.get(tensor.data_ptr())
    if region is None or tensor.numel() * tensor.element_size() != region.nbytes:
        return None
    return region


def map_region(region: SharedRegion) -> mmap.mmap | None:
    """`region` mapped read-only into this process, or None where it cannot be (see the module)."""
    if region.host != host_id():
        return None
    try:
        fd = os.open(f"/proc/{region.pid}/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        log.info("cannot open the shared KV cache of process %d (%s): its pulls go through UCX", region.pid, e)
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != region.file_id or st.st_size != region.nbytes:
            return None  # the process is gone and its pid, or fd number, went to another
        return mmap.mmap(fd, region.nbytes, prot=mmap.PROT_READ)
    except OSError as e:
        log.info("cannot map the shared KV cache of process %d (%s): its pulls go through UCX", region.pid, e)
        return None
    finally:
        os.close(fd)


def is_gone(region: SharedRegion) -> bool:
    """Whether the process that shared `region` on this host has exited: its fd no longer names the
    region's file (a region of another host: False, nothing of it is mapped here)."""
    if region.host != host_id():
        return False
    try:
        st = os.stat(f"/proc/{region.pid}/fd/{region.fd}")
    except FileNotFoundError:
        return True
    except OSError:  # no permission: not ours to judge
        return False
    return (st.st_dev, st.st_ino) != region.file_id


def seals(fd: int) -> int:
    """The seals on a memfd (`SEALS` on a KV cache's)."""
    return fcntl.fcntl(fd, _F_GET_SEALS)
