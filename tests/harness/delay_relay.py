"""A transparent TCP relay that delays every byte, run inside a lab node's namespace
(`Lab.delay`): this kernel has no netem, so delay needs a process on the path.

The node's nftables redirect its new TCP connections to a peer (`nat output`, `redirect`) to this
relay on loopback. For each one the relay reads where it was going (SO_ORIGINAL_DST), connects
there itself with a socket mark the redirect rule skips, and forwards both directions, each byte
`--delay-ms` after it arrived, in order. At most `MAX_BUFFERED` bytes wait per direction (the
sender is then not read from: backpressure, not memory)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import time

SO_ORIGINAL_DST = 80
MARK = 0x2A  # the relay's own connections: the redirect rule passes them by
MAX_BUFFERED = 16 << 20


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward reader -> writer, each chunk `delay_s` after it was read."""
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(MAX_BUFFERED // 65536)

    async def read():
        while True:
            await room.acquire()
            chunk = await reader.read(65536)
            await queue.put((time.monotonic() + delay_s, chunk))
            if not chunk:
                return

    async def write():
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            room.release()
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(write())]
    try:
        await asyncio.gather(*tasks)
    except (ConnectionError, OSError):
        pass
    finally:
        for t in tasks:
            t.cancel()


async def relay(delay_s: float, client_reader, client_writer) -> None:
    host, port = original_destination(client_writer.get_extra_info("socket"))
    upstream = socket.socket()
    upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
    upstream.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(upstream, (host, port))
        server_reader, server_writer = await asyncio.open_connection(sock=upstream)
    except OSError:
        upstream.close()
        client_writer.close()
        return
    await asyncio.gather(pump(client_reader, server_writer, delay_s), pump(server_reader, client_writer, delay_s))
    for w in (client_writer, server_writer):
        w.close()


async def main(port: int, delay_s: float) -> None:
    server = await asyncio.start_server(lambda r, w: relay(delay_s, r, w), "127.0.0.1", port)
    print("ready", server.sockets[0].getsockname()[1], flush=True)  # the port taken (0: the kernel picks)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0, help="default: one the kernel picks (printed)")
    ap.add_argument("--delay-ms", type=float, required=True)
    args = ap.parse_args()
    asyncio.run(main(args.port, args.delay_ms / 1e3))
