"""DeepSeek-V3's latent KV cache over each network backend (tcp, the default, and ucx): a prefill
engine (TP 1) exports a prompt's blocks and each rank of a TP-2 decode replica pulls them whole, no
head slicing, over the wire and out of shared memory; every rank lands the very bytes prefill
computed, (kv_lora_rank + qk_rope_head_dim) values a token a layer."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.kv_cache import KVCache  # noqa: E402
from pdserve.engine.models.arch import ModelArch  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kvtransfer.backends import BACKENDS, layout_of  # noqa: E402
from pdserve.kvtransfer.blocks import gather_blocks  # noqa: E402
from tests.harness.hf_checkpoints import write_checkpoint  # noqa: E402
from tests.harness.waiting import wait_until  # noqa: E402

HAS_UCX = importlib.util.find_spec("ucxx") is not None

BLOCK = 8


@pytest.fixture(scope="module")
def prefilled(checkpoints, tmp_path_factory):
    """A TP-1 prefill engine on a DeepSeek-V3 checkpoint holding one 100-token prompt's blocks."""
    model = str(write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), checkpoints["tiny-llama"]))
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, block_size=BLOCK, num_threads=1))
    engine.add_request("r", list(range(20, 120)), SamplingParams(max_tokens=4, temperature=0), prefill_only=True)
    first = None
    while first is None or first.kv_block_ids is None:
        first = next(iter(engine.step()), first)
    yield model, engine, first.kv_block_ids
    engine.shutdown()


@pytest.mark.parametrize("backend", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    not HAS_UCX, reason="ucxx is not installed"))])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["wire", "shared-memory"])
def test_prefill_tp1_to_decode_tp2_each_rank_pulls_the_whole_latent(prefilled, shared_memory, backend):
    model, engine, blocks = prefilled
    arch = ModelArch.from_dir(model)
    kv = engine.kv_cache.kv
    layout = layout_of(kv, "m")
    assert layout.is_latent and layout.num_kv_heads == 1 and layout.head_dim == arch.latent_dim
    exporter_cls, importer_cls = BACKENDS[backend]()
    exporter = exporter_cls("prefill-0", kv, layout, engine.block_pool.incref, engine.block_pool.free,
                           shared_memory=shared_memory)
    try:
        handle = exporter.export("r", blocks, 100)
        expected = gather_blocks(kv, blocks)
        pulled = []
        for rank in (0, 1):  # a decode rank's cache: the same latent layout (the latent is not split)
            dst = KVCache(arch.num_layers, 32, BLOCK, 1, arch.latent_dim, is_latent=True).kv
            importer = importer_cls(dst, layout_of(dst, "m", tp_size=2, tp_rank=rank))
            ids = list(range(3, 3 + 2 * len(blocks), 2))  # scattered on this side
            try:
                importer.pull(handle, ids, ack=rank == 1)
            finally:
                importer.close()
            assert importer.num_shared_memory_pulls == shared_memory
            pulled.append(gather_blocks(dst, ids))
        assert torch.equal(pulled[0], expected) and torch.equal(pulled[1], expected)
        assert expected.abs().sum() > 0  # the prompt's latents, not an empty cache
        # Bytes per token a rank receives: (kv_lora_rank + qk_rope_head_dim) * 4 (fp32) per layer.
        per_token = arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 4
        assert expected.nbytes == len(blocks) * BLOCK * per_token
        # The exporter takes the last rank's ACK on its own loop (thread), after that pull has returned.
        wait_until(lambda: len(exporter.leases) == 0, what="the lease released by the ACK")
    finally:
        exporter.close()
