"""A GPU cache shared over CUDA IPC: refused wherever it cannot be opened (checked here on any
machine). Opened from another process with the exporter's bytes, on a GPU:
tests/integration/engine/test_cuda_ipc.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.engine import cuda_ipc
from pdserve.engine.shared_memory import host_id

SHAPE = (2, 2, 6, 4, 2, 8)  # [layers, 2, blocks, block_size, heads, head_dim]
REGION = cuda_ipc.CudaRegion(host_id(), 1, "GPU-0", "ab" * 32, 2 * 2 * 6 * 4 * 2 * 8 * 4, 0,
                             b"/torch_1_2_3".hex(), 0, "cd" * 32, True)


def test_a_cpu_tensor_is_not_shared():
    assert cuda_ipc.share(torch.zeros(SHAPE)) is None


@pytest.mark.parametrize("change", [{"host": "elsewhere/boot"}, {"nbytes": 4}])
def test_regions_that_cannot_be_opened_here_give_none(change):
    assert cuda_ipc.open_region(replace(REGION, **change), torch.float32, SHAPE, "cuda:0") is None
