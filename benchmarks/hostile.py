"""What the heaviest requests the gateway takes cost a stream beside them (#39).

    python benchmarks/hostile.py              # 3 rounds each way (~3 minutes on 2 cores)
    python benchmarks/hostile.py --rounds 1

The disaggregated app (--preset, Serving's serve-llama-40m by default: a stream at a served model's
pace, which outlasts the heavy requests; prefill and decode replicas one core each, HAProxy ingress as
`pdserve serve` starts it) streams one long greedy completion over HTTP; every chunk's arrival is
timed. After the first `--before` chunks, three clients send, in parallel and `--repeats` times
each, the heaviest requests the gateway's default bounds let in: a text prompt just under the
4 MiB body limit (refused by the character bound), 16,000 prompts in one request (refused by the
count), and a request with the most stop strings allowed (16 of 512 characters, served). The
figure: the stream's largest inter-chunk gap while they run against its p99 gap before they
started, in the same stream (target: at most 2x). Two kinds of control rounds alternate with the
measured ones: the same stream with no heavy requests (what a quiet stream shows), and with the
same heavy requests sent, by the same client processes, to a discarding HTTP server instead of
the gateway (`--sink`: what sending those bytes costs this machine, pdserve aside).
`--heavy empties` sends instead a body of a million empty prompts (`[[], [], ...]`, ~4 MB), the
costliest JSON to parse per byte. `--link-mbit N` (root) sends the heavy requests, to the gateway
and to the sink alike, from a network namespace over a link of N Mbit/s (tests/harness/netns.py's
lab: a veth and a bridge, the node's sends shaped by tc tbf), as a client on another machine sends
them, instead of over loopback at memory speed; the stream stays on loopback. Prints a markdown
table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import requests

from machine import machine_line, netns_lab  # this folder's scripts run with it on sys.path


HEAVY = ("4mib", "prompts", "stops")


def _heavy(model: str, which: tuple[str, ...] = HEAVY) -> list[dict]:
    bodies = {"4mib": {"model": model, "prompt": "x" * ((4 << 20) - 200), "max_tokens": 2},
              "prompts": {"model": model, "prompt": [[5]] * 16_000, "max_tokens": 2},
              "stops": {"model": model, "prompt": "hello", "max_tokens": 8, "stop": ["\u00e9" * 512] * 16},
              # not among the three: the costliest JSON to parse per byte (~4 MB, a million lists)
              "empties": {"model": model, "prompt": [[]] * 1_000_000, "max_tokens": 2}}
    return [bodies[w] for w in which]


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else 0.0)


def _sink(ports, host: str) -> None:
    """A discarding HTTP server (a thread per connection): reads each request whole, answers 400."""
    import socketserver

    class Discard(socketserver.BaseRequestHandler):
        def handle(self):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = self.request.recv(65536)
                if not chunk:
                    return
                head += chunk
            headers, body = head.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                chunk = self.request.recv(1 << 20)
                if not chunk:
                    return
                body += chunk
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = socketserver.ThreadingTCPServer((host, 0), Discard)
    ports.put(server.server_address[1])
    server.serve_forever()


def _send(url: str, data: bytes, repeats: int, statuses, go, netns: str | None) -> None:
    """A heavy client, in a process of its own (started before the stream, waiting for `go`):
    this process's GIL and its fork are then no part of what the stream's gaps show. With `netns`,
    it sends from that namespace (entered first: the forked process has one thread)."""
    if netns:
        netns_lab().enter(netns)
    go.wait()
    for _ in range(repeats):
        statuses.append(requests.post(url, data=data, timeout=120, headers={"Content-Type": "application/json"})
                        .status_code)


def stream_round(base: str, model: str, max_tokens: int, before: int, repeats: int, heavy: bool,
                 control_window_s: float = 0.0, which: tuple[str, ...] = HEAVY, heavy_url: str | None = None,
                 sink: bool = False, netns: str | None = None) -> dict:
    """One stream; with `heavy`, the heavy requests (to `heavy_url`: the gateway's by default, or
    a discarding server's, `sink`; sent from `netns` when given) from its `before`-th chunk on, the
    window lasting until they are all answered; without, a window of `control_window_s` there."""
    arrivals: list[float] = []
    window: dict[str, float] = {}
    ctx = mp.get_context("fork")
    statuses, go = ctx.Manager().list(), ctx.Event()
    url = heavy_url or f"{base}/v1/completions"
    senders = [ctx.Process(target=_send, args=(url, json.dumps(body).encode(), repeats, statuses, go, netns))
               for body in _heavy(model, which)] if heavy else []
    for t in senders:
        t.start()
    body = {"model": model, "prompt": "The lighthouse keeper", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the stream was refused: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == before:
                window["start"] = arrivals[-1]
                go.set()
            if "start" in window and "end" not in window and (
                    not any(t.is_alive() for t in senders) if heavy else arrivals[-1] - window["start"] >= control_window_s):
                window["end"] = arrivals[-1]
    unfinished = heavy and "end" not in window  # the stream ended first: its window would be cut short
    for t in senders:
        t.join()
    if unfinished:
        raise RuntimeError(f"the stream ended ({len(arrivals)} chunks) before the heavy requests were answered: "
                           "give it more --max-tokens")
    if "start" not in window:
        raise RuntimeError(f"the stream ended after {len(arrivals)} chunks, before chunk {before}")
    window.setdefault("end", arrivals[-1])
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    # Before: from chunk 10 (past the first steps' warm-up) to the start of the window.
    before_gaps = gaps[min(10, before // 2):before - 1] or gaps[:1]
    during = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]) if window["start"] <= a < window["end"]]
    return {"heavy": ("to the sink" if sink else "yes") if heavy else "no", "chunks": len(arrivals),
            "window_ms": (window["end"] - window["start"]) * 1e3, "statuses": sorted(statuses),
            "p99_gap_before_ms": _p99(before_gaps), "max_gap_before_ms": max(before_gaps),
            "p99_gap_during_ms": _p99(during) if during else None, "max_gap_during_ms": max(during) if during else None,
            "ratio": (max(during) / _p99(before_gaps)) if during else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (and as many control rounds)")
    ap.add_argument("--max-tokens", type=int, default=600, help="the stream's length")
    ap.add_argument("--before", type=int, default=200, help="chunks before the heavy requests start")
    ap.add_argument("--repeats", type=int, default=3, help="times each heavy request is sent")
    ap.add_argument("--heavy", default=",".join(HEAVY), help="which heavy requests, comma-separated (default: "
                                                             "the three above; one alone shows what it costs; "
                                                             "or empties)")
    ap.add_argument("--sink", action="store_true", help="add control rounds that send the heavy requests to a "
                                                        "discarding server instead of the gateway")
    ap.add_argument("--preset", default="serve-llama-40m", help="the model (a checkpoint preset, generated on "
                                                                "first use)")
    ap.add_argument("--link-mbit", type=int, help="send the heavy requests from a network namespace over a link "
                                                  "of this many Mbit/s (root) instead of over loopback")
    args = ap.parse_args()
    if args.link_mbit and (why := netns_lab().unavailable()) is not None:
        raise SystemExit(f"--link-mbit {why}")

    import ray
    from ray import serve

    from pdserve.app import build
    from pdserve.config import ServeConfig
    from pdserve.engine.checkpoint import default_model
    from pdserve.launch import ray_env

    one_core = {"ray_actor_options": {"num_cpus": 1}, "engine": {"num_threads": 1}}
    config = ServeConfig(name="hostile", model=str(default_model(args.preset)), prefill=one_core, decode=one_core,
                         transfer={"host": "127.0.0.1"})
    for name, value in ray_env(config, None).items():  # as `pdserve serve` starts Ray
        os.environ.setdefault(name, value)
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # With a link, the gateway listens on every address: the heavy clients reach it on the lab's bridge.
    serve.start(http_options={"host": "0.0.0.0" if args.link_mbit else "127.0.0.1", "port": port})
    rows, lab, from_netns, heavy_host = [], None, None, "127.0.0.1"
    try:
        if args.link_mbit:
            lab = netns_lab().Lab()
            node = lab.add_node("clients")
            lab.rate(node, args.link_mbit)
            from_netns, heavy_host = node.netns, lab.head_ip
        serve.run(build(config), name=config.name, route_prefix="/")
        base, model = f"http://127.0.0.1:{port}", config.served_model_name
        stream_round(base, model, 64, 1, 0, heavy=False)  # warm-up (a cold gateway may send its tokens in few chunks)
        sink_url = None
        if args.sink:
            ports = mp.get_context("fork").Queue()
            sink = mp.get_context("fork").Process(target=_sink, args=(ports, heavy_host), daemon=True)
            sink.start()
            sink_url = f"http://{heavy_host}:{ports.get(timeout=10)}/"
        which = tuple(args.heavy.split(","))
        for r in range(args.rounds):  # each measured round, then the control rounds over as long a window
            measured = stream_round(base, model, args.max_tokens, args.before, args.repeats, heavy=True, which=which,
                                    heavy_url=f"http://{heavy_host}:{port}/v1/completions", netns=from_netns)
            round_rows = [measured, stream_round(base, model, args.max_tokens, args.before, 0, heavy=False,
                                                 control_window_s=measured["window_ms"] / 1e3)]
            if sink_url:
                round_rows.append(stream_round(base, model, args.max_tokens, args.before, args.repeats, heavy=True,
                                               which=which, heavy_url=sink_url, sink=True, netns=from_netns))
            for row in round_rows:
                rows.append({"round": r + 1, **row})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        if lab:
            lab.close()
    print(f"\n{machine_line()}\n`python benchmarks/hostile.py --rounds {args.rounds} --repeats {args.repeats}"
          f"{' --heavy ' + args.heavy if args.heavy != ','.join(HEAVY) else ''}{' --sink' if args.sink else ''}"
          f"{f' --link-mbit {args.link_mbit}' if args.link_mbit else ''}"
          f"{f' --preset {args.preset}' if args.preset != 'serve-llama-40m' else ''}`\n")
    print("| round | heavy requests | answers | p99 gap before (ms) | max gap before (ms) | window (ms) "
          "| p99 gap during (ms) | max gap during (ms) | max during / p99 before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['heavy']} | "
              f"{','.join(map(str, row['statuses'])) or '-'} | {row['p99_gap_before_ms']:.1f} | "
              f"{row['max_gap_before_ms']:.1f} | {row['window_ms']:.0f} | {row['p99_gap_during_ms'] or 0:.1f} | "
              f"{row['max_gap_during_ms'] or 0:.1f} | {row['ratio'] or 0:.2f} |")
    print(json.dumps({"benchmark": "hostile", "machine": machine_line(), "rows": rows}))


if __name__ == "__main__":
    main()
