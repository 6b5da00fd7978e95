"""Shared-memory tensors: what a KV cache lives in so another process on this host can map it."""

import gc
import multiprocessing as mp
import os
from dataclasses import replace

import numpy as np
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.shared_memory import host_id, locate, map_region, shared_zeros


def _read_in_child(region, replies) -> None:
    mapping = map_region(region)
    replies.put(None if mapping is None else np.frombuffer(mapping, dtype=np.float32)[:4].tolist())


def test_a_shared_tensor_is_zeros_and_found_by_its_region():
    t = shared_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    region = locate(t)
    assert region is not None and region.pid == os.getpid() and region.host == host_id()
    assert region.nbytes == 3 * 5 * 7 * 2
    assert locate(t[1]) is None and locate(torch.zeros(3)) is None  # a view, a private tensor


def test_another_process_maps_it_and_sees_the_writes():
    t = shared_zeros((4, 1024), torch.float32)
    t[0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    for region, expected in ((locate(t), [1.0, 2.0, 3.0, 4.0]),
                             (replace(locate(t), file_id=(0, 0)), None),  # the fd names another file
                             (replace(locate(t), host="elsewhere/0"), None),  # another host
                             (replace(locate(t), pid=2 ** 22 + 1), None)):  # no such process
        proc = ctx.Process(target=_read_in_child, args=(region, replies))
        proc.start()
        assert replies.get(timeout=60) == expected
        proc.join(10)


def test_its_memory_and_fd_go_with_the_last_view():
    t = shared_zeros((1024,), torch.float32)
    region = locate(t)
    view = t[10:]
    del t
    gc.collect()
    assert os.path.exists(f"/proc/self/fd/{region.fd}")  # the view keeps the memory
    del view
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{region.fd}") or map_region(region) is None


def test_a_cpu_kv_cache_is_in_shared_memory():
    cache = KVCache(2, 8, 16, 4, 64, torch.bfloat16)
    assert locate(cache.kv) is not None and not cache.kv.any()


def _resident_shared_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))


def test_its_pages_are_taken_at_allocation_not_on_first_write():
    # Left to fault in on first write, each page cost a kernel zeroing in whatever wrote it first:
    # an engine step, a prefill, a KV pull.
    before = _resident_shared_bytes()
    t = shared_zeros((16, 1 << 20), torch.float32)  # 64 MiB
    assert _resident_shared_bytes() - before >= 0.95 * t.numel() * t.element_size()


def _write_in_child(region, replies) -> None:
    """Try every way a process of the same user might write into the region; report what worked."""
    import mmap as mm

    path = f"/proc/{region.pid}/fd/{region.fd}"
    worked = []
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        replies.put(["open refused"])
        return
    try:
        try:
            mm.mmap(fd, region.nbytes, prot=mm.PROT_READ | mm.PROT_WRITE).close()
            worked.append("writable map")
        except OSError:
            pass
        try:
            os.pwrite(fd, b"\xff" * 8, 0)
            worked.append("write")
        except OSError:
            pass
        try:
            os.ftruncate(fd, region.nbytes * 2)
            worked.append("grow")
        except OSError:
            pass
        mm.mmap(fd, region.nbytes, prot=mm.PROT_READ).close()  # reading stays allowed
    finally:
        os.close(fd)
    replies.put(worked)


def test_no_other_process_can_write_into_the_cache():
    """The memfd is sealed once the owner has mapped it: another process of the same user can open
    it but neither map it writable, write to it, nor resize it; the owner still writes."""
    from pdserve.engine.shared_memory import SEALS, seals

    t = shared_zeros((4, 1024), torch.float32)
    region = locate(t)
    assert seals(region.fd) & SEALS == SEALS
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    proc = ctx.Process(target=_write_in_child, args=(region, replies))
    proc.start()
    assert replies.get(timeout=60) == []
    proc.join(10)
    t[0, 0] = 7.0  # the owner's own mapping is as writable as before
    assert not t[1:].any() and t[0, 0] == 7.0
