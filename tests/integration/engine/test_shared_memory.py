"""Another process on this host maps a shared-memory tensor and sees the owner's writes, and can
neither map it writable, write to it nor resize it (the spawned half of
tests/unit/engine/test_shared_memory.py)."""

import multiprocessing as mp
import os
from dataclasses import replace

import numpy as np
import torch

from pdserve.engine.shared_memory import locate, map_region, shared_zeros


def _read_in_child(region, replies) -> None:
    mapping = map_region(region)
    replies.put(None if mapping is None else np.frombuffer(mapping, dtype=np.float32)[:4].tolist())


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
