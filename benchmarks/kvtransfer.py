"""KV transfer benchmark: pdserve's UCX pull against raw ucxx send/recv and a plain TCP socket,
between the same two processes, in one run.

    python benchmarks/kvtransfer.py [--repeats 10]

Payloads: the KV of a 2,048-token prompt of the ~56M benchmark model (8 layers, 4 KV heads, head
dim 64, fp32, block size 16: 32 MiB) and a 64 MiB one (4,096 tokens). Every transfer opens its
own connection, as a pull does. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time

os.environ.setdefault("UCX_TLS", "tcp")

LAYOUT = dict(model_id="bench-llama-56m", num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
TOKENS = {"2048-token KV (32 MiB)": 2048, "64 MiB": 4096}
NUM_BLOCKS = 4096 // 16 + 8


def _server(replies, repeats: int) -> None:
    """The sending process: a pdserve exporter, a raw ucxx listener and a TCP listener."""
    import numpy as np
    import torch
    import ucxx

    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.protocol import KVLayout
    from pdserve.kvtransfer.ucx_backend import UCXExporter

    kv = torch.randn(8, 2, NUM_BLOCKS, 16, 4, 64)
    pool = BlockPool(NUM_BLOCKS, 16)
    exporter = UCXExporter("bench", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=600)
    handles = {}
    for name, tokens in TOKENS.items():
        blocks = list(range(tokens // 16))
        handles[name] = [exporter.export(f"{tokens}-{i}", blocks, tokens).to_dict() for i in range(repeats + 2)]
    payload = np.random.bytes(64 << 20)
    buf = np.frombuffer(payload, dtype=np.uint8)

    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)

    def tcp_loop():
        while True:
            conn, _ = tcp.accept()
            with conn:
                (n,) = struct.unpack("<Q", conn.recv(8, socket.MSG_WAITALL))
                conn.sendall(memoryview(payload)[:n])

    import threading

    threading.Thread(target=tcp_loop, daemon=True).start()

    async def main():
        async def handler(ep):
            size = np.empty(1, dtype=np.uint64)
            await ep.recv(size)
            await ep.send(buf[: int(size[0])])
            await ep.recv(np.empty(1, dtype=np.uint8))  # closing before the peer has it resets the link
            await ep.close()

        listener = ucxx.create_listener(handler, port=0)
        replies.put((exporter.address, handles, listener.port, tcp.getsockname()[1]))
        while True:
            await asyncio.sleep(3600)

    asyncio.run(main())


def _measure(fn, nbytes: int, repeats: int) -> dict:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    p50 = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
    return {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "gb_s": nbytes / p50 / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    import numpy as np
    import torch
    import ucxx

    from pdserve.kvtransfer.protocol import KVHandle, KVLayout
    from pdserve.kvtransfer.ucx_backend import UCXImporter

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    server = ctx.Process(target=_server, args=(replies, args.repeats), daemon=True)
    server.start()
    address, handles, ucx_port, tcp_port = replies.get(timeout=120)
    kv = torch.zeros(8, 2, NUM_BLOCKS, 16, 4, 64)
    importer = UCXImporter(kv, KVLayout(**LAYOUT))
    raw_loop = asyncio.new_event_loop()

    def raw_ucxx(nbytes: int):
        async def go():
            ep = await ucxx.create_endpoint("127.0.0.1", ucx_port)
            await ep.send(np.array([nbytes], dtype=np.uint64))
            out = np.empty(nbytes, dtype=np.uint8)
            await ep.recv(out)
            await ep.send(np.ones(1, dtype=np.uint8))
            await ep.close()
        raw_loop.run_until_complete(go())

    def plain_tcp(nbytes: int):
        out = bytearray(nbytes)
        with socket.create_connection(("127.0.0.1", tcp_port)) as s:
            s.sendall(struct.pack("<Q", nbytes))
            view, got = memoryview(out), 0
            while got < nbytes:
                got += s.recv_into(view[got:])

    rows, record = [], {}
    for name, tokens in TOKENS.items():
        nbytes = tokens * 8 * 2 * 4 * 64 * 4
        queue = [KVHandle.from_dict(h) for h in handles[name]]
        dst = list(range(tokens // 16))
        ours = _measure(lambda: importer.pull(queue.pop(), dst), nbytes, args.repeats)
        raw = _measure(lambda: raw_ucxx(nbytes), nbytes, args.repeats)
        tcp = _measure(lambda: plain_tcp(nbytes), nbytes, args.repeats)
        record[name] = {"bytes": nbytes, "pdserve_ucx": ours, "raw_ucxx": raw, "plain_tcp": tcp}
        for label, r in (("pdserve UCX pull", ours), ("raw ucxx send/recv", raw), ("plain TCP socket", tcp)):
            rows.append(f"| {name} | {label} | {r['gb_s']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
        rows.append(f"| {name} | pdserve / raw ucxx | {ours['gb_s'] / raw['gb_s']:.0%} | | |")
    importer.close()
    server.kill()
    print(f"command: python benchmarks/kvtransfer.py --repeats {args.repeats}; UCX_TLS={os.environ['UCX_TLS']}\n")
    print("| payload | path | GB/s (p50) | p50 ms | p99 ms |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps({"bench": "kvtransfer", "results": record}))


if __name__ == "__main__":
    main()
