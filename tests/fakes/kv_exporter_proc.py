"""A prefill-side process for the KV transfer tests: a seeded random cache, a pool, a UCX exporter.

Commands arrive on a queue: ("export", request_id, num_tokens) -> handle dict; ("free",) -> the
pool's free block count; ("stop",). The cache is `make_cache(...)`, so the test process can
rebuild the exact same bytes to compare against.
"""

from __future__ import annotations

import os

LAYOUT = dict(model_id="test-model", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
NUM_BLOCKS = 4096


def make_cache(num_blocks: int = NUM_BLOCKS):
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randn(LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"],
                       LAYOUT["head_dim"], generator=g)


def serve(commands, replies, lease_s: float) -> None:
    os.environ.setdefault("UCX_TLS", "tcp")
    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.protocol import KVLayout
    from pdserve.kvtransfer.ucx_backend import UCXExporter

    kv = make_cache()
    pool = BlockPool(NUM_BLOCKS, LAYOUT["block_size"])
    exporter = UCXExporter("prefill-0", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=lease_s)
    replies.put(("ready", exporter.address))
    while True:
        cmd = commands.get()
        if cmd[0] == "export":
            _, rid, num_tokens = cmd
            blocks = pool.allocate(-(-num_tokens // LAYOUT["block_size"]))
            handle = exporter.export(rid, blocks, num_tokens)
            pool.free(blocks)  # the engine's own reference ends; the lease keeps them pinned
            replies.put(("handle", handle.to_dict()))
        elif cmd[0] == "free":
            replies.put(("free", pool.num_free_blocks))
        else:
            exporter.close()
            replies.put(("stopped",))
            return
