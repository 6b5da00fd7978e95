"""What hostile peers cost an engine replica's output listener (#40): per attack, the replica
process's memory growth and its event loop's longest stall, while an honest gateway streams.

    python benchmarks/hostile_peers.py

The "replica" is a child process running an `OutputChannelServer` on its event loop, with a
heartbeat task that wakes every 5 ms and records how late it woke (the loop's stall), and an
honest gateway's connection over which it streams one output per millisecond. The parent process
attacks the listener, one attack at a time, each for a few seconds:
- bomb: a hello whose length prefix says 16 MiB, followed by 16 MiB of one-byte msgpack arrays
  (unpacked, that was +1.17 GiB before #40);
- flood: 256 MiB sent after a hello (with the right secret) that claims another gateway id;
- wrong secret: 2,000 hellos with a wrong secret, one connection each;
- connections: 2,000 connections opened and held silent;
- duplicate: 200 hellos with the honest gateway's id and the secret.
Targets: memory growth under 64 MiB, longest stall under 100 ms, and the honest stream's outputs
all delivered in order. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import socket
import struct
import time

import msgpack

from machine import machine_line  # this folder's scripts run with it on sys.path


def _replica(conn) -> None:
    """The child: listener, heartbeat, honest stream; answers the parent's commands."""
    import psutil

    from pdserve.engine.outputs import RequestOutput
    from pdserve.output.receiver import OutputChannels
    from pdserve.output.sender import OutputChannelServer

    async def main():
        server = OutputChannelServer("127.0.0.1", lambda ids: None)
        offer = await server.offer()
        honest = OutputChannels()
        honest.offer(offer)
        while server.sink(honest.gateway_id) is None:
            await asyncio.sleep(0.01)
        state = {"max_stall_ms": 0.0, "sent": 0, "received": 0, "in_order": True}

        async def heartbeat():
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(0.005)
                state["max_stall_ms"] = max(state["max_stall_ms"], (loop.time() - t - 0.005) * 1e3)

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

        tasks = [asyncio.ensure_future(heartbeat()), asyncio.ensure_future(stream())]
        proc = psutil.Process()
        loop = asyncio.get_running_loop()
        conn.send({"port": offer.port, "secret": offer.secret, "gateway": honest.gateway_id})
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                break
            if cmd == "reset":
                state["max_stall_ms"] = 0.0
                conn.send({"rss": proc.memory_info().rss})
            elif cmd == "report":
                conn.send({**state, "rss": proc.memory_info().rss,
                           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                           "open": server._num_open, "connections": server.num_connections,
                           "honest_connected": server.sink(honest.gateway_id) is not None})
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


def attack(name: str, port: int, secret: str, gateway: str) -> None:
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


ATTACKS = ("bomb", "flood", "wrong secret", "connections", "duplicate")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_replica, args=(child,))
    proc.start()
    where = parent.recv()
    time.sleep(1)  # the honest stream running
    rows = []
    try:
        for name in ATTACKS:
            parent.send("reset")
            rss0 = parent.recv()["rss"]
            t = time.perf_counter()
            attack(name, where["port"], where["secret"], where["gateway"])
            took = time.perf_counter() - t
            time.sleep(0.5)
            parent.send("report")
            r = parent.recv()
            rows.append({"attack": name, "seconds": took, "rss_growth_mib": (r["rss"] - rss0) / 2**20,
                         "max_stall_ms": r["max_stall_ms"], "honest_in_order": r["in_order"],
                         "honest_received": r["received"], "honest_connected": r["honest_connected"],
                         "open_after": r["open"]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        parent.send("stop")
        proc.join(10)
    print(f"\n{machine_line()}\n`python benchmarks/hostile_peers.py`\n")
    print("| attack | seconds | replica RSS growth (MiB) | longest loop stall (ms) | honest stream | open after |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        honest = ("in order, connected" if row["honest_in_order"] and row["honest_connected"]
                  else "DISTURBED")
        print(f"| {row['attack']} | {row['seconds']:.1f} | {row['rss_growth_mib']:.1f} | {row['max_stall_ms']:.1f} | "
              f"{honest} ({row['honest_received']} outputs so far) | {row['open_after']} |")
    print(json.dumps({"benchmark": "hostile_peers", "machine": machine_line(), "rows": rows}))


if __name__ == "__main__":
    main()
