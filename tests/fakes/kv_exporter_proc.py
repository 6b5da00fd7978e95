"""A prefill-side process for the KV transfer tests: a seeded random cache, a pool, an exporter of
the network backend named (`tcp` or `ucx`).

Commands arrive on a queue: ("export", request_id, num_tokens) -> handle dict;
("export_scattered", request_id, num_tokens) -> the same over every other block (the exporter then
gathers chunk by chunk); ("free",) -> the pool's free block count; ("connections",) -> connections
accepted so far and open now; ("open_reads",) -> reads holding blocks now; ("listeners",) -> the
TCP ports this process listens on, as [(ip, port)], and whether ucxx was imported; ("digest",
block_ids) -> a hash of those blocks' bytes and the address of the first one's memory; ("stop",).
The cache is `make_cache(...)`, so the test process can rebuild the exact same bytes to compare
against. With `shared`, the cache is in shared memory (`shared_zeros`), as an engine's is:
importers on this host copy out of it (the local path).
`stall` is an exporter that sends the DATA frame and a few chunks of a pull, then nothing (over UCX
messages, or on a plain TCP stream as the tcp backend frames them).
"""

from __future__ import annotations

import hashlib
import os
import sys

LAYOUT = dict(model_id="test-model", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
NUM_BLOCKS = 4096


def make_cache(num_blocks: int = NUM_BLOCKS):
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randn(LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"],
                       LAYOUT["head_dim"], generator=g)


def listening_ports() -> list[tuple[str, int]]:
    """The TCP sockets this process listens on, on any address, IPv4 or IPv6: [(ip, port)]."""
    import ipaddress

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                (ip, port), state, inode = fields[1].split(":"), fields[3], fields[9]
                if state == "0A" and inode in inodes:  # LISTEN
                    # The kernel prints the address as 32-bit words in host order (little-endian here).
                    raw = b"".join(bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, len(ip), 8))
                    found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


class ExporterProcess:
    """This module's exporter in a process of its own (spawned), driven over its queues."""

    def __init__(self, backend: str, lease_s: float = 30.0, idle_timeout_s: float = 300.0, shared: bool = False,
                 max_connections: int | None = None, host: str = "127.0.0.1"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.backend, self.commands, self.replies, self.shared = backend, ctx.Queue(), ctx.Queue(), shared
        self.proc = ctx.Process(target=serve, args=(self.commands, self.replies, lease_s, idle_timeout_s, shared,
                                                    max_connections, backend, host), daemon=True)
        self.proc.start()
        kind, self.address = self.replies.get(timeout=60)
        assert kind == "ready"

    def call(self, *cmd):
        self.commands.put(cmd)
        return self.replies.get(timeout=30)[1:]

    def export(self, rid, num_tokens):
        from pdserve.kvtransfer.protocol import KVHandle

        return KVHandle.from_dict(self.call("export", rid, num_tokens)[0])

    def export_scattered(self, rid, num_tokens):
        from pdserve.kvtransfer.protocol import KVHandle

        return KVHandle.from_dict(self.call("export_scattered", rid, num_tokens)[0])

    def free_blocks(self) -> int:
        return self.call("free")[0]

    def connections(self) -> tuple[int, int]:
        """Connections the exporter accepted so far, and how many are open now."""
        return tuple(self.call("connections"))

    def open_reads(self) -> int:
        return self.call("open_reads")[0]

    def stop(self):
        if self.proc.is_alive():
            self.commands.put(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def serve(commands, replies, lease_s: float, idle_timeout_s: float = 300.0, shared: bool = False,
          max_connections: int | None = None, backend: str = "tcp", host: str = "127.0.0.1") -> None:
    os.environ.setdefault("UCX_TLS", "tcp")
    from pdserve.engine.kv_cache import BlockPool
    from pdserve.engine.shared_memory import shared_zeros
    from pdserve.kvtransfer.backends import BACKENDS
    from pdserve.kvtransfer.protocol import KVLayout

    kv = make_cache()
    if shared:
        kv = shared_zeros(kv.shape, kv.dtype).copy_(kv)
    pool = BlockPool(NUM_BLOCKS, LAYOUT["block_size"])
    cap = {} if max_connections is None else {"max_connections": max_connections}
    exporter_cls, _ = BACKENDS[backend]()
    exporter = exporter_cls("prefill-0", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=lease_s,
                           idle_timeout_s=idle_timeout_s, host=host, **cap)
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
        elif cmd[0] == "open_reads":
            replies.put(("open_reads", exporter.leases.num_open_reads))
        elif cmd[0] == "listeners":
            replies.put(("listeners", listening_ports(), "ucxx" in sys.modules))
        elif cmd[0] == "digest":
            digest = hashlib.sha256(kv[:, :, cmd[1]].contiguous().numpy().tobytes()).hexdigest()
            replies.put(("digest", digest, kv[0, 0, cmd[1][0]].data_ptr()))
        else:
            exporter.close()
            replies.put(("stopped",))
            return


def _stalled_pull(req: dict, num_blocks: int) -> tuple[dict, list[int]]:
    """The DATA frame a stalling exporter answers `req` with, and its chunks' sizes in bytes."""
    from pdserve.kvtransfer import protocol as p

    heads = req["layout"]["num_kv_heads"] // req["layout"]["tp_size"]
    shape = [LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], heads, LAYOUT["head_dim"]]
    slab_bytes = num_blocks * LAYOUT["block_size"] * heads * LAYOUT["head_dim"] * 4
    chunks = p.chunk_bounds(2 * LAYOUT["num_layers"], slab_bytes)
    return {"shape": shape, "num_chunks": len(chunks)}, [(s1 - s0) * slab_bytes for s0, s1 in chunks]


def stall(replies, num_blocks: int, num_chunks_sent: int, late_s: float | None = None, backend: str = "tcp") -> None:
    """Answer every READ with a DATA frame for `num_blocks` blocks and `num_chunks_sent` chunks
    of zeros, then keep the connection open and send nothing more; with `late_s`, send the rest
    (bytes of 0x7f) that much later, past an importer's deadline, then put ("late", whether the
    importer took them) on `replies`."""
    if backend == "tcp":
        return _stall_tcp(replies, num_blocks, num_chunks_sent, late_s)
    os.environ.setdefault("UCX_TLS", "tcp")
    import asyncio

    import numpy as np
    import ucxx

    from pdserve.kvtransfer import protocol as p
    from pdserve.kvtransfer.ucx_backend import _recv_frame, _send_frame

    async def main():
        async def handler(ep):
            _, req = await _recv_frame(ep)
            data, chunks = _stalled_pull(req, num_blocks)
            await _send_frame(ep, p.DATA, data)
            for nbytes in chunks[:num_chunks_sent]:
                await ep.send(np.zeros(nbytes, dtype=np.uint8))
            if late_s is not None:
                await asyncio.sleep(late_s)
                try:
                    for nbytes in chunks[num_chunks_sent:]:
                        await ep.send(np.full(nbytes, 0x7F, dtype=np.uint8))
                    replies.put(("late", True))
                except Exception:  # noqa: BLE001 - the importer aborted: what it must have done
                    replies.put(("late", False))
            await asyncio.sleep(3600)

        listener = ucxx.create_listener(handler, port=0)
        replies.put(("ready", f"127.0.0.1:{listener.port}"))
        await asyncio.sleep(3600)

    asyncio.run(main())


def _stall_tcp(replies, num_blocks: int, num_chunks_sent: int, late_s: float | None) -> None:
    """`stall` on a plain TCP stream, framed as `tcp_backend` frames it: one thread per connection."""
    import socket
    import threading
    import time

    from pdserve.kvtransfer import protocol as p
    from tests.fakes.kv_peer import recv_frame

    def handle(conn: socket.socket) -> None:
        _, req = recv_frame(conn)
        data, chunks = _stalled_pull(req, num_blocks)
        conn.sendall(p.encode_frame(p.DATA, data))
        for nbytes in chunks[:num_chunks_sent]:
            conn.sendall(bytes(nbytes))
        if late_s is not None:
            time.sleep(late_s)
            try:
                for nbytes in chunks[num_chunks_sent:]:
                    conn.sendall(b"\x7f" * nbytes)
                replies.put(("late", True))
            except OSError:  # the importer closed the connection: what it must have done
                replies.put(("late", False))
        time.sleep(3600)

    listener = socket.create_server(("127.0.0.1", 0))
    replies.put(("ready", f"127.0.0.1:{listener.getsockname()[1]}"))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
