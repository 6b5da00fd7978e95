"""A GPU cache shared over CUDA IPC, opened from another process: the exporter's bytes, its blocks
copied into this process's cache, and a forged reference counter refused (GPU only; the checks
that run on any machine are in tests/unit/engine/test_cuda_ipc.py)."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace

import pytest
import torch

from pdserve.engine import cuda_ipc
from pdserve.kvtransfer.blocks import copy_blocks

SHAPE = (2, 2, 6, 4, 2, 8)  # [layers, 2, blocks, block_size, heads, head_dim]


def _exporter(regions, done) -> None:
    kv = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32, device="cuda").view(SHAPE)
    torch.cuda.synchronize()
    regions.put(cuda_ipc.share(kv).__dict__)
    done.wait(60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_another_process_cache_opens_and_its_blocks_copy_over():
    ctx = multiprocessing.get_context("spawn")
    regions, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_exporter, args=(regions, done), daemon=True)
    child.start()
    try:
        region = cuda_ipc.CudaRegion.from_dict(regions.get(timeout=120))
        forged = replace(region, ref_counter=b"/etc/passwd".hex())
        assert cuda_ipc.open_region(forged, torch.float32, SHAPE, "cuda:0") is None
        source = cuda_ipc.open_region(region, torch.float32, SHAPE, "cuda:0")
        expected = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
        assert torch.equal(source.cpu(), expected)
        kv = torch.zeros(2, 2, 5, 4, 1, 8, device="cuda")
        copy_blocks(source, [4, 1], (1, 2), kv, [0, 3])
        torch.cuda.synchronize()
        assert torch.equal(kv[:, :, [0, 3]].cpu(), expected[:, :, [4, 1], :, 1:2])
        del source
    finally:
        done.set()
        child.join(30)
