"""A prefill-side process for the KV transfer tests: a seeded random cache, a pool, a UCX exporter.

Commands arrive on a queue: ("export", request_id, num_tokens) -> handle dict;
("export_scattered", request_id, num_tokens) -> the same over every other block (the exporter then
gathers chunk by chunk); ("free",) -> the pool's free block count; ("connections",) -> connections
accepted so far and open now; ("stop",). The cache is `make_cache(...)`, so the test process can
rebuild the exact same bytes to compare against. With `shared`, the cache is in shared memory
(`shared_zeros`), as an engine's is: importers on this host copy out of it (the local path).
`stall` is an exporter that sends the DATA frame and a few chunks of a pull, then nothing.
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


def serve(commands, replies, lease_s: float, idle_timeout_s: float = 300.0, shared: bool = False,
          max_connections: int | None = None) -> None:
    os.environ.setdefault("UCX_TLS", "tcp")
    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.protocol import KVLayout
    from pdserve.kvtransfer.ucx_backend import UCXExporter
    from pdserve.engine.shared_memory import shared_zeros

    kv = make_cache()
    if shared:
        kv = shared_zeros(kv.shape, kv.dtype).copy_(kv)
    pool = BlockPool(NUM_BLOCKS, LAYOUT["block_size"])
    cap = {} if max_connections is None else {"max_connections": max_connections}
    exporter = UCXExporter("prefill-0", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=lease_s,
                           idle_timeout_s=idle_timeout_s, **cap)
    replies.put(("ready", exporter.address))
    while True:
        cmd = commands.get()
        if cmd[0] == "export":
            _, rid, num_tokens = cmd
            blocks = pool.allocate(-(-num_tokens // LAYOUT["block_size"]))
            handle = exporter.export(rid, blocks, num_tokens)
            pool.free(blocks)  # the engine's own reference ends; the lease keeps them pinned
            replies.put(("handle", handle.to_dict()))
        elif cmd[0] == "export_scattered":
            _, rid, num_tokens = cmd
            blocks = pool.allocate(2 * -(-num_tokens // LAYOUT["block_size"]))
            handle = exporter.export(rid, blocks[::2], num_tokens)
            pool.free(blocks)
            replies.put(("handle", handle.to_dict()))
        elif cmd[0] == "free":
            replies.put(("free", pool.num_free_blocks))
        elif cmd[0] == "connections":
            replies.put(("connections", exporter.num_connections, exporter.num_open_connections))
        else:
            exporter.close()
            replies.put(("stopped",))
            return


def stall(replies, num_blocks: int, num_chunks_sent: int, late_s: float | None = None) -> None:
    """Answer every READ with a DATA frame for `num_blocks` blocks and `num_chunks_sent` chunks
    of zeros, then keep the connection open and send nothing more; with `late_s`, send the rest
    (bytes of 0x7f) that much later, past an importer's deadline."""
    os.environ.setdefault("UCX_TLS", "tcp")
    import asyncio

    import numpy as np
    import ucxx

    from pdserve.kvtransfer import protocol as p
    from pdserve.kvtransfer.ucx_backend import _recv_frame, _send_frame

    async def main():
        async def handler(ep):
            _, req = await _recv_frame(ep)
            heads = req["layout"]["num_kv_heads"] // req["layout"]["tp_size"]
            shape = [LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], heads, LAYOUT["head_dim"]]
            slab_bytes = num_blocks * LAYOUT["block_size"] * heads * LAYOUT["head_dim"] * 4
            chunks = p.chunk_bounds(2 * LAYOUT["num_layers"], slab_bytes)
            await _send_frame(ep, p.DATA, {"shape": shape, "num_chunks": len(chunks)})
            for s0, s1 in chunks[:num_chunks_sent]:
                await ep.send(np.zeros((s1 - s0) * slab_bytes, dtype=np.uint8))
            if late_s is not None:
                await asyncio.sleep(late_s)
                try:
                    for s0, s1 in chunks[num_chunks_sent:]:
                        await ep.send(np.full((s1 - s0) * slab_bytes, 0x7F, dtype=np.uint8))
                except Exception:  # noqa: BLE001 - the importer aborted: what it must have done
                    pass
            await asyncio.sleep(3600)

        listener = ucxx.create_listener(handler, port=0)
        replies.put(("ready", f"127.0.0.1:{listener.port}"))
        await asyncio.sleep(3600)

    asyncio.run(main())
