"""KV transfer benchmark: pdserve's pulls (the tcp backend, the default, and the ucx backend) against
raw ucxx send/recv and a plain TCP socket,
and pdserve's local pull (the exporter's cache in shared memory, copied out by the importer)
against one memcpy of the same bytes, between the same two processes, in one run, timed in turns.

    python benchmarks/kvtransfer.py [--repeats 10] [--netns]

Payloads: the KV of a 2,048-token prompt of the ~56M benchmark model (8 layers, 4 KV heads, head
dim 64, fp32, block size 16: 32 MiB) and a 64 MiB one (4,096 tokens), each in blocks that are one
run on both sides (sent and received in place), the 2,048-token KV again in scattered blocks
on both sides (every other block: gathered and scattered chunk by chunk), and one block (256 KiB:
what a pull costs besides its bytes). Raw ucxx and the socket
open a connection per transfer and move the same number of bytes; pdserve's pulls keep theirs, as a
decode replica does (the local pull sends only its READ and ACK over it, or with the tcp backend
only its ACK: the lease checked on the exporter's lease board, beside the same pull with a READ); the memcpy
copies the bytes between two buffers of the importer's process. The cost of the lease tokens (#40):
the same pull from an exporter whose lease table ignores them (`_TokenlessLeases`, here only), with
handles that carry none. Besides the time, each path's CPU
time in the importer's process (what a pull takes from the decode replica's engine). Prints a
markdown table and one JSON line.

--netns (root): the two processes on two nodes of a network-namespace lab (tests/harness/netns.py),
so every byte crosses two veths and a bridge, as between pods on different hosts; the local
pull and the memcpy then have no link to cross and are left out.

--layouts: instead, bytes per token by cache layout (#44): a 2,048-token prompt's KV, 8 layers,
bf16, block size 16, in DeepSeek-V3's latent layout (576 values a token a layer: kv_lora_rank 512
+ qk_rope_head_dim 64, one plane, no heads) against GQA with 8 KV heads of 128 (K and V: 2,048
values), each pulled over UCX by a decode rank of TP 1 and of TP 2 (a GQA rank pulls its 4 heads,
a latent rank the whole latent), against raw ucxx moving the same bytes, timed in turns.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time

from machine import netns_lab  # this folder's scripts run with it on sys.path (it starts no thread)

os.environ.setdefault("UCX_TLS", "tcp")

LAYOUT = dict(model_id="bench-llama-56m", num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
# payload -> (tokens, block stride: 1 = one run of blocks, 2 = every other block on both sides)
# One block too: what a pull costs besides its bytes (the round trips, the lease check).
PAYLOADS = {"2048-token KV (32 MiB)": (2048, 1), "64 MiB": (4096, 1), "2048-token KV, scattered blocks": (2048, 2),
            "one block (16 tokens, 256 KiB)": (16, 1)}
NUM_BLOCKS = 4096 // 16 + 8  # also holds 2,048 tokens at every other block


def _block_ids(tokens: int, stride: int) -> list[int]:
    return list(range(0, tokens // 16 * stride, stride))


def _tokenless_leases(table):
    """`table`'s class without the token check: a read or ack naming a request id is enough (what a
    pull cost before #40; a baseline here, never in pdserve)."""

    class TokenlessLeases(type(table)):
        def _live(self, request_id, token):
            lease = self._leases.get(request_id)
            return super()._live(request_id, lease.token if lease else token)

        def release(self, request_id, token):
            lease = self._leases.get(request_id)
            return super().release(request_id, lease.token if lease else token)

    table.__class__ = TokenlessLeases
    return table


def _server(replies, repeats: int, netns: str | None = None, host: str = "127.0.0.1") -> None:
    """The sending process: a pdserve exporter, a raw ucxx listener and a TCP listener."""
    if netns:  # first: numpy, torch and UCX start threads, and setns moves only the calling one
        netns_lab().enter(netns)
    import numpy as np
    import torch
    import ucxx

    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.protocol import KVLayout
    from pdserve.kvtransfer.tcp_backend import TCPExporter
    from pdserve.kvtransfer.ucx_backend import UCXExporter, ucx_loop
    from pdserve.engine.shared_memory import shared_zeros

    kv = torch.randn(8, 2, NUM_BLOCKS, 16, 4, 64)
    pool = BlockPool(NUM_BLOCKS, 16)
    exporters = {"tcp": TCPExporter("bench-tcp", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=600,
                                    host=host, shared_memory=False),
                 "ucx": UCXExporter("bench", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=600, host=host),
                 "local": UCXExporter("bench-shared", shared_zeros(kv.shape, kv.dtype).copy_(kv), KVLayout(**LAYOUT),
                                      pool.incref, pool.free, lease_s=600),
                 "local_tcp": TCPExporter("bench-shared-tcp", shared_zeros(kv.shape, kv.dtype).copy_(kv),
                                          KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=600),
                 "ucx_tokenless": UCXExporter("bench-tokenless", kv, KVLayout(**LAYOUT), pool.incref, pool.free,
                                              lease_s=600, host=host)}
    _tokenless_leases(exporters["ucx_tokenless"].leases)
    handles = {}
    for name, (tokens, stride) in PAYLOADS.items():
        blocks = _block_ids(tokens, stride)
        handles[name] = {path: [e.export(f"{name}-{i}", blocks, tokens).to_dict() for i in range(repeats + 2)]
                         for path, e in exporters.items()}
        for h in handles[name]["ucx_tokenless"]:
            h["lease_token"] = ""
        # The same local reads with the lease asked by a READ, as before the lease board
        handles[name]["local_tcp_read"] = [{**h, "lease_slot": -1} for h in
                                           (exporters["local_tcp"].export(f"{name}-read-{i}", blocks, tokens).to_dict()
                                            for i in range(repeats + 2))]
    payload = np.random.bytes(64 << 20)
    buf = np.frombuffer(payload, dtype=np.uint8)

    tcp = socket.socket()
    tcp.bind((host, 0))
    tcp.listen(16)

    def tcp_loop():
        while True:
            conn, _ = tcp.accept()
            with conn:
                (n,) = struct.unpack("<Q", conn.recv(8, socket.MSG_WAITALL))
                conn.sendall(memoryview(payload)[:n])

    import threading

    threading.Thread(target=tcp_loop, daemon=True).start()

    async def handler(ep):
        size = np.empty(1, dtype=np.uint64)
        await ep.recv(size)
        await ep.send(buf[: int(size[0])])
        await ep.recv(np.empty(1, dtype=np.uint8))  # closing before the peer has it resets the link
        await ep.close()

    async def listen():
        return ucxx.create_listener(handler, port=0)

    # On the loop UCX started on (the exporter's): ucxx completes its requests there.
    listener = ucx_loop().run(listen(), 30)
    replies.put((handles, listener.port, tcp.getsockname()[1]))
    while True:
        time.sleep(3600)


# --layouts: name -> (layout's model id, cache shape per block for `layout_of`: planes, heads, head dim)
LAYOUTS = {"DeepSeek-V3 latent (512 + 64)": ("deepseek-v3-latent", 1, 1, 576),
           "GQA, 8 KV heads x 128": ("gqa-8x128", 2, 8, 128)}
LAYOUT_LAYERS, LAYOUT_TOKENS = 8, 2048


def _layout_cache(planes: int, heads: int, head_dim: int, zeros: bool = False):
    import torch

    shape = (LAYOUT_LAYERS, planes, NUM_BLOCKS, 16, heads, head_dim)
    return torch.zeros(shape, dtype=torch.bfloat16) if zeros else torch.randn(shape).to(torch.bfloat16)


def _layout_server(replies, repeats: int) -> None:
    """The sending process for --layouts: one UCX exporter per layout (private caches: every byte
    goes over UCX) and a raw ucxx listener."""
    import numpy as np
    import ucxx

    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.backends import layout_of
    from pdserve.kvtransfer.ucx_backend import UCXExporter, ucx_loop

    pool = BlockPool(NUM_BLOCKS, 16)
    blocks = _block_ids(LAYOUT_TOKENS, 1)
    handles = {}
    for name, (model_id, planes, heads, head_dim) in LAYOUTS.items():
        kv = _layout_cache(planes, heads, head_dim)
        e = UCXExporter(model_id, kv, layout_of(kv, model_id), pool.incref, pool.free, lease_s=600,
                        shared_memory=False)
        handles[name] = [e.export(f"{name}-{i}", blocks, LAYOUT_TOKENS).to_dict() for i in range(2 * (repeats + 2))]
    buf = np.frombuffer(np.random.bytes(64 << 20), dtype=np.uint8)

    async def handler(ep):
        size = np.empty(1, dtype=np.uint64)
        await ep.recv(size)
        await ep.send(buf[: int(size[0])])
        await ep.recv(np.empty(1, dtype=np.uint8))
        await ep.close()

    async def listen():
        return ucxx.create_listener(handler, port=0)

    listener = ucx_loop().run(listen(), 30)
    replies.put((handles, listener.port))
    while True:
        time.sleep(3600)


def _layouts(repeats: int) -> None:
    """--layouts: see the module docstring."""
    import numpy as np
    import ucxx

    from machine import machine_line  # this folder's scripts run with it on sys.path
    from pdserve.kvtransfer.backends import layout_of
    from pdserve.kvtransfer.protocol import KVHandle
    from pdserve.kvtransfer.ucx_backend import UCXImporter, ucx_loop

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    server = ctx.Process(target=_layout_server, args=(replies, repeats), daemon=True)
    server.start()
    handles, port = replies.get(timeout=300)
    raw_out = np.ones(64 << 20, dtype=np.uint8)

    def raw_ucxx(nbytes: int):
        async def go():
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            await ep.send(np.array([nbytes], dtype=np.uint64))
            await ep.recv(raw_out[:nbytes])
            await ep.send(np.ones(1, dtype=np.uint8))
            await ep.close()
        ucx_loop().run(go())

    dst, paths, sizes, importers = _block_ids(LAYOUT_TOKENS, 1), {}, {}, []
    for name, (model_id, planes, heads, head_dim) in LAYOUTS.items():
        queue = [KVHandle.from_dict(h) for h in handles[name]]
        for tp in (1, 2):
            local_heads = heads if planes == 1 else heads // tp  # the latent is not split
            kv = _layout_cache(planes, local_heads, head_dim, zeros=True)
            importer = UCXImporter(kv, layout_of(kv, model_id, tp, 0))
            importers.append(importer)
            key = f"{name}, decode TP {tp} (per rank)"
            paths[key] = (lambda imp, q: lambda: imp.pull(q.pop(), dst))(importer, queue)
            sizes[key] = nbytes = LAYOUT_LAYERS * planes * local_heads * head_dim * 2 * LAYOUT_TOKENS
            paths[f"raw ucxx, {nbytes >> 20} MiB"] = (lambda n: lambda: raw_ucxx(n))(nbytes)
            sizes[f"raw ucxx, {nbytes >> 20} MiB"] = nbytes
    timed = _measure(paths, 0, repeats)  # (GB/s filled in below: the sizes differ by path)
    for key, nbytes in sizes.items():
        timed[key].update(bytes=nbytes, gb_s=nbytes / timed[key]["p50_ms"] / 1e6)
    rows = []
    for key, nbytes in sizes.items():
        if key.startswith("raw ucxx"):
            continue
        r, raw = timed[key], timed[f"raw ucxx, {nbytes >> 20} MiB"]
        per_token = nbytes // LAYOUT_TOKENS
        rows.append(f"| {key} | {per_token // (2 * LAYOUT_LAYERS)} | {per_token} | {nbytes / 2**20:.1f} "
                    f"| {nbytes / r['p50_ms'] / 1e6:.2f} | {r['p50_ms']:.1f} | {r['p50_ms'] * 1e3 / LAYOUT_TOKENS:.2f} "
                    f"| {raw['p50_ms']:.1f} ({raw['p50_ms'] / r['p50_ms']:.0%}) |")
        timed[key]["bytes_per_token"] = per_token
    for importer in importers:
        importer.close()
    server.kill()
    print(f"command: python benchmarks/kvtransfer.py --layouts --repeats {repeats}; UCX_TLS={os.environ['UCX_TLS']}")
    print(f"machine: {machine_line()}\n")
    print(f"{LAYOUT_TOKENS}-token prompt, {LAYOUT_LAYERS} layers, bf16, UCX pull on loopback\n")
    print("| layout, decode rank | values per token per layer | bytes per token (all layers) | MiB per prompt "
          "| GB/s (p50) | p50 ms | us per token | raw ucxx p50 ms, same bytes (pull at % of it) |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps({"bench": "kvtransfer_layouts", "results": timed}))


def _measure(fns: dict, nbytes: int, repeats: int) -> dict:
    """Each path warmed up, then timed in turns (path A, B, C, A, B, C, ...), so a change in the
    machine's load during the run falls on all of them alike."""
    for fn in fns.values():
        fn()
    times, cpu = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    out = {}
    for name, ts in times.items():
        p50 = statistics.median(ts)
        p99 = sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))]
        out[name] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "gb_s": nbytes / p50 / 1e9,
                     "cpu_p50_ms": statistics.median(cpu[name]) * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--netns", action="store_true", help="run the two processes on two nodes of a namespace lab (root)")
    ap.add_argument("--layouts", action="store_true", help="bytes per token: DeepSeek-V3's latent against GQA 8x128")
    args = ap.parse_args()
    if args.layouts:
        return _layouts(args.repeats)
    lab = host = None
    if args.netns:
        netns = netns_lab()
        if (why := netns.unavailable()) is not None:
            raise SystemExit(f"--netns {why}")
        lab = netns.Lab()
        prefill, decode = lab.add_node("prefill"), lab.add_node("decode")
        host = prefill.ip
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # in this namespace, out of the lab's reach when it closes
        netns.enter(decode.netns)  # before any thread starts (below: numpy, torch, UCX)

    import numpy as np
    import torch
    import ucxx

    from pdserve.kvtransfer.protocol import KVHandle, KVLayout
    from pdserve.kvtransfer.tcp_backend import TCPImporter
    from pdserve.kvtransfer.ucx_backend import UCXImporter, ucx_loop

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    server = ctx.Process(target=_server, daemon=True,
                         args=(replies, args.repeats, prefill.netns if lab else None, host or "127.0.0.1"))
    host = host or "127.0.0.1"
    server.start()
    handles, ucx_port, tcp_port = replies.get(timeout=120)
    kv = torch.zeros(8, 2, NUM_BLOCKS, 16, 4, 64)
    importer = UCXImporter(kv, KVLayout(**LAYOUT))
    tcp_importer = TCPImporter(kv, KVLayout(**LAYOUT))

    # The baselines receive into one reused buffer, as the importer receives into its cache (or a
    # reused staging buffer): a fresh one would cost them page faults on every transfer.
    raw_out, tcp_out = np.ones(64 << 20, dtype=np.uint8), bytearray(b"\1" * (64 << 20))
    copy_src = np.frombuffer(np.random.bytes(64 << 20), dtype=np.uint8)

    def raw_ucxx(nbytes: int):
        async def go():
            ep = await ucxx.create_endpoint(host, ucx_port)
            await ep.send(np.array([nbytes], dtype=np.uint64))
            await ep.recv(raw_out[:nbytes])
            await ep.send(np.ones(1, dtype=np.uint8))
            await ep.close()
        ucx_loop().run(go())  # the importer's loop: one UCX loop per process

    def plain_tcp(nbytes: int):
        with socket.create_connection((host, tcp_port)) as s:
            s.sendall(struct.pack("<Q", nbytes))
            view, got = memoryview(tcp_out)[:nbytes], 0
            while got < nbytes:
                got += s.recv_into(view[got:])

    rows, record = [], {}
    for name, (tokens, stride) in PAYLOADS.items():
        nbytes = tokens * 8 * 2 * 4 * 64 * 4
        queues = {path: [KVHandle.from_dict(h) for h in hs] for path, hs in handles[name].items()}
        dst = _block_ids(tokens, stride)
        paths = {"pdserve_tcp": lambda: tcp_importer.pull(queues["tcp"].pop(), dst),
                 "pdserve_ucx": lambda: importer.pull(queues["ucx"].pop(), dst),
                 "pdserve_ucx_tokenless": lambda: importer.pull(queues["ucx_tokenless"].pop(), dst),
                 "raw_ucxx": lambda: raw_ucxx(nbytes), "plain_tcp": lambda: plain_tcp(nbytes)}
        if not lab:
            paths.update({"pdserve_local": lambda: importer.pull(queues["local"].pop(), dst),
                          "pdserve_local_tcp": lambda: tcp_importer.pull(queues["local_tcp"].pop(), dst),
                          "pdserve_local_tcp_read": lambda: tcp_importer.pull(queues["local_tcp_read"].pop(), dst),
                          "memcpy": lambda: np.copyto(raw_out[:nbytes], copy_src[:nbytes])})
        timed = _measure(paths, nbytes, args.repeats)
        record[name] = {"bytes": nbytes, **timed}
        for label, key in (("pdserve tcp pull", "pdserve_tcp"), ("pdserve UCX pull", "pdserve_ucx"),
                           ("pdserve UCX pull, no lease tokens", "pdserve_ucx_tokenless"),
                           ("raw ucxx send/recv", "raw_ucxx"),
                           ("plain TCP socket", "plain_tcp"), ("pdserve local pull (ucx: READ and ACK)", "pdserve_local"),
                           ("pdserve local pull (tcp: the lease board, then the ACK)", "pdserve_local_tcp"),
                           ("pdserve local pull (tcp: READ and ACK)", "pdserve_local_tcp_read"),
                           ("memcpy in the importer", "memcpy")):
            if key not in timed:
                continue
            r = timed[key]
            rows.append(f"| {name} | {label} | {r['gb_s']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                        f"| {r['cpu_p50_ms']:.1f} |")
        for ours, base in (("pdserve_tcp", "plain_tcp"), ("pdserve_ucx", "pdserve_ucx_tokenless"), ("pdserve_ucx", "raw_ucxx"),
                           ("pdserve_ucx", "plain_tcp"), ("pdserve_local", "memcpy"), ("pdserve_local_tcp", "memcpy"),
                           ("pdserve_local_tcp", "pdserve_local_tcp_read")):
            if ours not in timed:
                continue
            rows.append(f"| {name} | {ours} / {base} | {timed[ours]['gb_s'] / timed[base]['gb_s']:.0%} | | | |")
    expected_local = 0 if lab else len(PAYLOADS) * (args.repeats + 1)
    assert importer.num_shared_memory_pulls == expected_local, "a pull took the wrong path"
    assert tcp_importer.num_shared_memory_pulls == 2 * expected_local, "a pull took the wrong path"
    assert tcp_importer.num_board_reads == expected_local, "a local pull did not ask the lease board"
    importer.close()
    tcp_importer.close()
    server.kill()
    if lab:
        lab.close()
    print(f"command: python benchmarks/kvtransfer.py --repeats {args.repeats}{' --netns' if lab else ''}; "
          f"UCX_TLS={os.environ['UCX_TLS']}\n")
    print("| payload | path | GB/s (p50) | p50 ms | p99 ms | importer CPU ms (p50) |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps({"bench": "kvtransfer", "results": record}))


if __name__ == "__main__":
    main()
