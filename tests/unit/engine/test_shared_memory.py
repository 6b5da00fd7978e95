"""Shared-memory tensors: what a KV cache lives in so another process on this host can map it.
(Another process mapping it, and failing to write into it: tests/integration/engine/test_shared_memory.py.)"""

import dataclasses
import gc
import os

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.shared_memory import host_id, is_gone, locate, map_region, shared_zeros


def test_a_shared_tensor_is_zeros_and_found_by_its_region():
    t = shared_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    region = locate(t)
    assert region is not None and region.pid == os.getpid() and region.host == host_id()
    assert region.nbytes == 3 * 5 * 7 * 2
    assert locate(t[1]) is None and locate(torch.zeros(3)) is None  # a view, a private tensor


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


def test_a_region_is_gone_once_its_fd_names_nothing_or_another_file():
    t = shared_zeros((1024,), torch.float32)
    region = locate(t)
    assert not is_gone(region)
    assert is_gone(dataclasses.replace(region, file_id=(region.file_id[0], region.file_id[1] + 1)))  # fd reused
    assert not is_gone(dataclasses.replace(region, host="elsewhere", pid=2 ** 22 + 1))  # nothing of it here
    del t
    gc.collect()
    assert is_gone(region)


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
