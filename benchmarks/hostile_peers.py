"""What hostile peers cost a replica's internal listeners (#40): per attack, the victim process's
memory growth and its event loop's longest stall, while honest traffic goes on beside it.

    python benchmarks/hostile_peers.py [--listener output|kv|kv-tcp|redis|all]

Each victim is a child process with a heartbeat task on the event loop that serves the listener
(it wakes every 5 ms and records how late it woke: the loop's stall), set up, then frozen for the
GC as Ray Serve freezes a replica's start. The parent attacks, one attack at a time. Targets: memory growth under 64 MiB, longest stall under 100 ms, the honest
traffic unchanged.

output (the replica's output connection, `OutputChannelServer`): an honest gateway's connection
streams one output per millisecond. Attacks: a hello whose length prefix says 16 MiB followed by
16 MiB of one-byte msgpack arrays (+1.17 GiB before #40); 256 MiB after a hello with the right
secret and another gateway id; 2,000 hellos with a wrong secret; 2,000 connections held silent;
200 hellos with the honest gateway's id and the secret.

kv (the prefill replica's UCX KV exporter, `UCXExporter`, over TCP): an honest decode process
pulls a leased 4-block KV every 10 ms and checks the bytes. Attacks: 500 READs of unknown request
ids; 20 control messages of 16 MiB; 500 garbage frames; 500 READs naming the honest requests' ids with wrong lease tokens
and a one-hour deadline; 500 ACKs of those ids with wrong tokens; 600 connections held silent
(cap 512). Each peer opens a connection of its own.

kv-tcp (the same replica with the tcp backend, the default: `TCPExporter`, a thread per connection
and no event loop of its own; the heartbeat runs on a loop of its own thread, as Serve's does
beside the exporter's threads): the same honest pulls and the same attacks over plain sockets
(the 16 MiB control messages as a header claiming 16 MiB and the bytes after it; cap 256), and
100 slowloris peers sending a READ one byte every half second for 3 s.

redis (the KV-event stream, `KVEventIndex` in a router and `KVEventPublisher` in a replica): the
replica publishes a new 4-block chain every 10 ms, the router's loop matches it every 5 ms; after
each attack, how long until the router has indexed the replica's latest chain. The attacker holds
the Redis password (a pod inside the cluster). Attacks: 50 entries of 8 MiB; 200 entries just
under the 1 MiB bound, each a list of a million integers; 2,000 garbage entries; 100 forged
entries of 40,000 fake blocks each, in the honest replica's name (the router indexes no more of
its blocks than its cache holds, 32,768 here, which the replica reports over Ray); resync
requests every millisecond for 5 s (the replica snapshots at most once a second).

Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import msgpack

from machine import machine_line  # this folder's scripts run with it on sys.path

os.environ.setdefault("UCX_TLS", "tcp")


async def _heartbeat(state: dict) -> None:
    """Wake every 5 ms on this loop; `state["max_stall_ms"]`: how late the latest wake-up came, at most."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.005)
        state["max_stall_ms"] = max(state["max_stall_ms"], (loop.time() - t - 0.005) * 1e3)


def _track_gc(state: dict) -> None:
    """`state["max_gc_ms"]`: the longest garbage collection since the last reset (any thread's;
    a full one stops every thread of the process, the loop's too)."""
    started = {}

    def callback(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            state["max_gc_ms"] = max(state.get("max_gc_ms", 0.0), (time.perf_counter() - started.pop("t")) * 1e3)

    gc.callbacks.append(callback)


def _answer(conn, state: dict, report) -> None:
    """The victim's side of the parent's commands (on the calling thread, until "stop"), once it is set up:
    "reset" -> {rss}; "report" -> {rss, max_stall_ms, honest (text, "ok" first when undisturbed),
    open_after}, from `report()`."""
    import psutil

    proc = psutil.Process()
    # As Ray Serve does at the end of a replica's start (RAY_SERVE_FREEZE_GC_ON_STARTUP): what the
    # start allocated stays out of later full collections (here ~100 ms each, with torch loaded).
    gc.collect()
    gc.freeze()
    _track_gc(state)
    while (cmd := conn.recv()) != "stop":
        if cmd == "reset":
            state["max_stall_ms"] = state["max_gc_ms"] = 0.0
            conn.send({"rss": proc.memory_info().rss})
        elif cmd == "report":
            conn.send({"rss": proc.memory_info().rss, "max_stall_ms": state["max_stall_ms"],
                       "max_gc_ms": state["max_gc_ms"], **report()})


# ---- output: the replica's output connection

def _output_replica(conn) -> None:
    """The listener, the heartbeat and the honest stream on one loop (Serve's, in a replica)."""
    from pdserve.engine.outputs import RequestOutput
    from pdserve.output.receiver import OutputChannels
    from pdserve.output.sender import OutputChannelServer

    state = {"max_stall_ms": 0.0, "sent": 0, "received": 0, "in_order": True}

    async def main():
        server = OutputChannelServer("127.0.0.1", lambda ids: None)
        offer = await server.offer()
        honest = OutputChannels()
        honest.offer(offer)
        while server.sink(honest.gateway_id) is None:
            await asyncio.sleep(0.01)

        async def stream():
            p = honest.register("honest")
            server.sink(honest.gateway_id).request_ids.add("honest")
            while True:
                sink = server.sink(honest.gateway_id)
                if sink is not None:
                    sink.send("honest", RequestOutput("honest", [state["sent"]], "x", False))
                    state["sent"] += 1
                while not p.queue.empty():
                    out = p.queue.get_nowait()
                    if isinstance(out, BaseException) or out.new_token_ids != [state["received"]]:
                        state["in_order"] = False
                    state["received"] += 1
                await asyncio.sleep(0.001)

        def report():
            connected = server.sink(honest.gateway_id) is not None
            return {"honest": f"{'ok' if state['in_order'] and connected else 'DISTURBED'}: {state['received']} "
                              f"outputs in order so far, {'connected' if connected else 'DISCONNECTED'}",
                    "open_after": f"{server._num_open} connections"}

        tasks = [asyncio.ensure_future(_heartbeat(state)), asyncio.ensure_future(stream())]
        conn.send({"port": offer.port, "secret": offer.secret, "gateway": honest.gateway_id})
        await asyncio.get_running_loop().run_in_executor(None, _answer, conn, state, report)
        for t in tasks:
            t.cancel()

    asyncio.run(main())


def _frame(payload) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _send_all(port: int, data: bytes, hold_s: float = 0.0) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(data)
            time.sleep(hold_s)
        except OSError:
            pass  # closed by the listener, as it should


def output_attack(name: str, port: int, secret: str, gateway: str) -> None:
    hello = {"v": 2, "conn": 7, "secret": secret}
    if name == "bomb":
        _send_all(port, struct.pack(">I", 16 << 20) + b"\x90" * (16 << 20))
    elif name == "flood":
        _send_all(port, _frame({**hello, "gateway": "f" * 32}) + b"\x00" * (256 << 20))
    elif name == "wrong secret":
        for i in range(2000):
            _send_all(port, _frame({**hello, "gateway": f"{i:032x}", "secret": "0" * 32}))
    elif name == "connections":
        held = []
        for _ in range(2000):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(2)
        for s in held:
            s.close()
    elif name == "duplicate":
        for _ in range(200):
            _send_all(port, _frame({**hello, "gateway": gateway}))


OUTPUT_ATTACKS = ("bomb", "flood", "wrong secret", "connections", "duplicate")


# ---- kv, kv-tcp: the prefill replica's KV exporter, UCX or tcp

KV_LAYOUT = dict(model_id="bench", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
KV_BLOCKS, HONEST_BLOCKS, HONEST_PULLS = 64, [8, 9, 10, 11], 8000


def _kv_cache():
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(2, 2, KV_BLOCKS, 16, 4, 64, generator=g)


def _kv_honest(conn, handles: list[dict], backend: str) -> None:
    """A decode replica: one leased pull every 10 ms, its bytes checked; answers "report"/"stop"."""
    import torch

    from pdserve.kvtransfer.backends import BACKENDS
    from pdserve.kvtransfer.blocks import gather_blocks
    from pdserve.kvtransfer.protocol import KVHandle, KVLayout

    expected = gather_blocks(_kv_cache(), HONEST_BLOCKS)
    importer = BACKENDS[backend]()[1](torch.zeros(2, 2, KV_BLOCKS, 16, 4, 64), KVLayout(**KV_LAYOUT))
    dst = [40, 41, 42, 43]
    done = {"ok": 0, "failed": 0, "slowest_ms": 0.0, "last_error": None}
    for h in handles:
        if conn.poll():
            if conn.recv() == "stop":
                break
            conn.send(dict(done))
            done["slowest_ms"] = 0.0
        t = time.perf_counter()
        try:
            importer.kv[:, :, dst] = 0
            importer.pull(KVHandle.from_dict(h), dst, timeout_s=10)
            done["ok" if torch.equal(gather_blocks(importer.kv, dst), expected) else "failed"] += 1
        except Exception as e:  # noqa: BLE001 - counted, and told
            done["failed"] += 1
            done["last_error"] = repr(e)[:200]
        done["slowest_ms"] = max(done["slowest_ms"], (time.perf_counter() - t) * 1e3)
        time.sleep(0.01)
    importer.close()


def _kv_replica(conn, backend: str) -> None:
    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.backends import BACKENDS
    from pdserve.kvtransfer.protocol import KVLayout

    pool = BlockPool(KV_BLOCKS, 16)
    exporter = BACKENDS[backend]()[0]("victim", _kv_cache(), KVLayout(**KV_LAYOUT), pool.incref, pool.free,
                                      lease_s=600, shared_memory=False)
    handles = [exporter.export(f"honest-{i}", HONEST_BLOCKS, 64).to_dict() for i in range(HONEST_PULLS)]
    state = {"max_stall_ms": 0.0}
    if backend == "ucx":
        from pdserve.kvtransfer.ucx_backend import ucx_loop

        loop = ucx_loop().loop  # the loop the listener serves on
    else:  # the exporter's threads beside a loop of the replica's own (Serve's)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(_heartbeat(state), loop)
    honest, theirs = mp.Pipe()
    decode = mp.get_context("spawn").Process(target=_kv_honest, args=(theirs, handles, backend), daemon=True)
    decode.start()

    def report():
        honest.send("report")
        r = honest.recv()
        return {"honest": f"{'ok' if r['failed'] == 0 and r['ok'] else 'DISTURBED'}: {r['ok']} pulls exact so far, "
                          f"{r['failed']} failed{' (' + r['last_error'] + ')' if r['last_error'] else ''}, "
                          f"slowest {r['slowest_ms']:.0f} ms",
                "open_after": f"{exporter.num_open_connections} connections, {exporter.leases.num_open_reads} reads"}

    conn.send({"address": exporter.address, "ids": [h["request_id"] for h in handles[-2000:]]})
    _answer(conn, state, report)
    honest.send("stop")
    decode.join(10)


def kv_attack(name: str, address: str, ids: list[str]) -> None:
    import numpy as np
    import ucxx

    from pdserve.kvtransfer import protocol as p
    from pdserve.kvtransfer.ucx_backend import _recv_frame, ucx_loop

    host, port = address.rsplit(":", 1)

    async def peer(*messages: bytes, reply: bool = True):
        ep = await ucxx.create_endpoint(host, int(port))
        try:
            for m in messages:
                await ep.send(np.frombuffer(m, dtype=np.uint8))
            if reply:
                await asyncio.wait_for(_recv_frame(ep), 5)
        except Exception:  # noqa: BLE001 - refused or closed: what the listener should do
            pass
        finally:
            ep.abort()

    async def run():
        if name == "unknown ids":
            for i in range(500):
                await peer(p.encode_frame(p.READ, {"request_id": f"unknown-{i}", "layout": dict(KV_LAYOUT)}))
        elif name == "bomb":
            for _ in range(20):
                await peer(os.urandom(16 << 20))
        elif name == "garbage":
            for _ in range(500):
                await peer(os.urandom(4096))
        elif name == "wrong token":
            layout = dict(KV_LAYOUT)
            for rid in ids[:500]:
                await peer(p.encode_frame(p.READ, {"request_id": rid, "lease_token": os.urandom(16).hex(),
                                                   "layout": layout, "timeout_s": 3600}))
        elif name == "ack wrong token":
            for rid in ids[:500]:
                await peer(p.encode_frame(p.ACK, {"request_id": rid, "lease_token": os.urandom(16).hex()}),
                           reply=False)
        elif name == "connections":
            held = []
            for _ in range(600):
                try:
                    held.append(await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), 5))
                except Exception:  # noqa: BLE001
                    break
            await asyncio.sleep(2)
            for ep in held:
                ep.abort()

    ucx_loop().run(run(), 300)


KV_ATTACKS = ("unknown ids", "bomb", "garbage", "wrong token", "ack wrong token", "connections")


def _tcp_peer(address: str, *messages: bytes, reply: bool = True) -> None:
    """One plain-socket connection: send `messages`, read the reply frame's header (or not), close."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            for m in messages:
                s.sendall(m)
            if reply:
                s.recv(64 << 10)
    except OSError:
        pass  # refused or reset: what the listener should do


def kv_tcp_attack(name: str, address: str, ids: list[str]) -> None:
    """`kv_attack`'s attacks over plain sockets, and slowloris peers."""
    from pdserve.kvtransfer import protocol as p

    host, port = address.rsplit(":", 1)
    if name == "unknown ids":
        for i in range(500):
            _tcp_peer(address, p.encode_frame(p.READ, {"request_id": f"unknown-{i}", "layout": dict(KV_LAYOUT)}))
    elif name == "bomb":
        for _ in range(20):
            _tcp_peer(address, p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, 16 << 20) + os.urandom(16 << 20))
    elif name == "garbage":
        for _ in range(500):
            _tcp_peer(address, os.urandom(4096))
    elif name == "wrong token":
        for rid in ids[:500]:
            _tcp_peer(address, p.encode_frame(p.READ, {"request_id": rid, "lease_token": os.urandom(16).hex(),
                                                       "layout": dict(KV_LAYOUT), "timeout_s": 3600}))
    elif name == "ack wrong token":
        for rid in ids[:500]:
            _tcp_peer(address, p.encode_frame(p.ACK, {"request_id": rid, "lease_token": os.urandom(16).hex()}),
                      reply=False)
    elif name == "connections":
        held = []
        for _ in range(600):
            try:
                held.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:
                break
        time.sleep(2)
        for s in held:
            s.close()
    elif name == "slowloris":
        frame = p.encode_frame(p.READ, {"request_id": ids[0], "lease_token": "x", "layout": dict(KV_LAYOUT)})
        peers = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
        for i in range(6):  # a byte every half second, 3 s
            for s in peers:
                try:
                    s.send(frame[i:i + 1])
                except OSError:
                    pass  # dropped
            time.sleep(0.5)
        for s in peers:
            s.close()


KV_TCP_ATTACKS = ("unknown ids", "bomb", "garbage", "wrong token", "ack wrong token", "connections", "slowloris")


# ---- redis: the KV-event stream

STREAM, PASSWORD_ENV = "pdserve:kv-events:bench:Prefill", "BENCH_REDIS_PASSWORD"
HONEST_CAPACITY = 32_768  # the replica's KV cache, in blocks (an 8B model's on an 80 GB GPU: ~30,000)


def _redis_honest(conn, url: str) -> None:
    """A replica publishing a new 4-block chain every 10 ms; answers "last" (its last chain,
    published) and "snapshots"; stops on "stop"."""
    from pdserve.engine.kv_cache import BlockStored
    from pdserve.router.kv_events import KVEventPublisher, topological

    pending, pairs, lock = [], [], threading.Lock()

    def take():
        with lock:
            out = list(pending)
            pending.clear()
            return out

    def snapshot():  # what its cache holds: the latest blocks
        with lock:
            return topological(pairs[-HONEST_CAPACITY:])

    publisher = KVEventPublisher(url, STREAM, "honest", take, snapshot, interval_s=0.01,
                                 password_env=PASSWORD_ENV).start()
    n, last = 0, []
    while True:
        chain = [(n << 8) + i + 1 for i in range(4)]
        with lock:
            pending.append(BlockStored(chain, None))
            pairs.extend(zip(chain, [None] + chain[:-1]))
        n += 1
        if conn.poll(0.01):
            cmd = conn.recv()
            if cmd == "stop":
                break
            time.sleep(0.05)  # two publishing rounds: `last` is out
            conn.send({"last": last, "snapshots": publisher.num_snapshots})
        last = chain
    publisher.close()


def _redis_router(conn, url: str) -> None:
    from pdserve.router.kv_events import KVEventIndex
    from pdserve.router.request_router import UNREPORTED_MAX_BLOCKS

    index = KVEventIndex(url, STREAM, UNREPORTED_MAX_BLOCKS, password_env=PASSWORD_ENV).start()
    index.set_replicas(["honest"])
    index.set_capacity("honest", HONEST_CAPACITY)  # as the replica's routing stats tell the router
    state = {"max_stall_ms": 0.0}
    honest, theirs = mp.Pipe()
    replica = mp.get_context("spawn").Process(target=_redis_honest, args=(theirs, url), daemon=True)
    replica.start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def route():  # the router's own work: a match every 5 ms
        while True:
            index.match([1, 2, 3, 4], ["honest"])
            await asyncio.sleep(0.005)

    for coro in (_heartbeat(state), route()):
        asyncio.run_coroutine_threadsafe(coro, loop)

    def report():
        honest.send("last")
        r, t = honest.recv(), time.monotonic()
        while (seen := index.match(r["last"], ["honest"])["honest"]) < 4 and time.monotonic() - t < 30:
            time.sleep(0.01)
        caught_up = f"indexed {time.monotonic() - t:.2f} s after it was published" if seen == 4 else "NOT indexed in 30 s"
        return {"honest": f"{'ok' if seen == 4 and index.mode == 'precise' else 'DISTURBED'}: the replica's latest "
                          f"chain {caught_up}; the replica took {r['snapshots']} snapshots so far",
                "open_after": f"{index.precise.num_blocks('honest')} blocks indexed for the replica; "
                              f"rejected so far: {index.rejected}"}

    conn.send({})
    _answer(conn, state, report)
    honest.send("stop")
    replica.join(10)


def redis_attack(name: str, url: str, password: str) -> None:
    import redis

    client = redis.Redis.from_url(url, password=password)
    entry = {"v": 1, "r": "honest", "id": 10**12}
    if name == "oversized":
        for i in range(50):
            client.xadd(STREAM, {**entry, "ev": os.urandom(8 << 20)})
    elif name == "near the bound":
        ints = msgpack.packb([[0, [1] * 1_000_000, None]])  # just under 1 MiB, a million-element list
        for i in range(200):
            client.xadd(STREAM, {**entry, "id": i + 1, "ev": ints})
    elif name == "garbage":
        for i in range(2000):
            client.xadd(STREAM, {"v": os.urandom(8), "r": os.urandom(40), "ev": os.urandom(1000)})
    elif name == "forged chains":
        for i in range(100):  # 4 M fake blocks "of" the honest replica
            chain = list(range((i + 1) << 40, ((i + 1) << 40) + 40_000))
            client.xadd(STREAM, {**entry, "id": 10**9 + i, "ev": msgpack.packb([[0, chain, None]])})
    elif name == "resync flood":
        t = time.monotonic()
        while time.monotonic() - t < 5:
            client.xadd(STREAM + ":resync", {"r": "*"}, maxlen=1000, approximate=True)
            time.sleep(0.001)
    client.close()


REDIS_ATTACKS = ("oversized", "near the bound", "garbage", "forged chains", "resync flood")


# ---- the parent

def run_listener(listener: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    parent, child = mp.Pipe()
    server = None
    if listener == "output":
        proc = ctx.Process(target=_output_replica, args=(child,))
        attacks = OUTPUT_ATTACKS
        def hit(name, w): output_attack(name, w["port"], w["secret"], w["gateway"])
    elif listener == "kv":
        proc = ctx.Process(target=_kv_replica, args=(child, "ucx"))
        attacks = KV_ATTACKS
        def hit(name, w): kv_attack(name, w["address"], w["ids"])
    elif listener == "kv-tcp":
        proc = ctx.Process(target=_kv_replica, args=(child, "tcp"))
        attacks = KV_TCP_ATTACKS
        def hit(name, w): kv_tcp_attack(name, w["address"], w["ids"])
    else:
        from pdserve.router.redis_server import LocalRedis

        password = os.urandom(16).hex()
        os.environ[PASSWORD_ENV] = password  # the children inherit it
        server = LocalRedis(password=password).start()
        proc = ctx.Process(target=_redis_router, args=(child, server.url))
        attacks = REDIS_ATTACKS
        def hit(name, w): redis_attack(name, server.url, password)
    proc.start()
    where = parent.recv()
    time.sleep(2)  # the honest traffic running
    rows = []
    try:
        for name in attacks:
            parent.send("reset")
            rss0 = parent.recv()["rss"]
            t = time.perf_counter()
            hit(name, where)
            took = time.perf_counter() - t
            time.sleep(0.5)
            parent.send("report")
            r = parent.recv()
            rows.append({"listener": listener, "attack": name, "seconds": took,
                         "rss_growth_mib": (r["rss"] - rss0) / 2**20, "max_stall_ms": r["max_stall_ms"],
                         "max_gc_ms": r["max_gc_ms"],
                         "honest": r["honest"], "open_after": r["open_after"]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        parent.send("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()
        if server is not None:
            server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listener", choices=("output", "kv", "kv-tcp", "redis", "all"), default="all")
    args = ap.parse_args()
    listeners = ("output", "kv", "kv-tcp", "redis") if args.listener == "all" else (args.listener,)
    rows = [row for listener in listeners for row in run_listener(listener)]
    print(f"\n{machine_line()}\n`python benchmarks/hostile_peers.py --listener {args.listener}`\n")
    print("| listener | attack | seconds | victim RSS growth (MiB) | longest loop stall (ms) | longest GC (ms) "
          "| honest traffic | after |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['listener']} | {row['attack']} | {row['seconds']:.1f} | {row['rss_growth_mib']:.1f} "
              f"| {row['max_stall_ms']:.1f} | {row['max_gc_ms']:.1f} | {row['honest']} | {row['open_after']} |")
    print(json.dumps({"benchmark": "hostile_peers", "machine": machine_line(), "rows": rows}))


if __name__ == "__main__":
    main()
