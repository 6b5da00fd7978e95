"""Soak (#42): a long mixed load against the disaggregated app, a replica killed every so often;
at the end every request accounted for, nothing held by any replica, and how each replica's
resident memory grew.

    python benchmarks/soak.py                                   # 100,000 requests, a kill every 10,000 (hours)
    python benchmarks/soak.py --requests 20000 --kill-every 5000
    python benchmarks/soak.py --requests 2000 --kill-every 0    # no kills: memory alone
    python benchmarks/soak.py --requests 24000 --kill-every 2000 --kill-pools Decode
                                    # the prefill replica lives through 11 decode replicas

Starts a local Ray and the disaggregated tiny app (pdserve.bench.soak.SOAK_CONFIG, or `--config`
YAML) on 127.0.0.1 behind Ray Serve's proxy on a free port, then drives pdserve.bench.soak's mix
(completions and chats, whole and streamed, shared prefixes, client cancellations mid-stream,
client timeouts, hostile bodies from tests/fakes/hostile_requests.py) at `--concurrency`. Every
`--kill-every` requests one engine replica's process gets SIGKILL, prefill and decode in turn
(or only the `--kill-pools` named), while the load goes on; Serve replaces it. Every
`--rss-period-s` each replica's (and the gateway's) RSS is read from /proc (in all, and its
private part) with the number of requests done by then. At the end: wait for the replicas to
hold nothing (up to `transfer.lease_s` + 30 s: a dead decode replica's leases expire), then print
the outcomes, the kills, each process's RSS growth per 10,000 requests after its first `--warmup`
requests (a least-squares slope), and what is still held; one JSON line, and the whole record to
`--out`. Exits 1 if any request is unaccounted for or anything is held.

The hostile corpus assumes a context of a few hundred tokens (it expects a 400 for 1,000 prompt
tokens): a `--config` with a longer one answers some of its bodies 200 (unaccounted).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from machine import machine_line  # this folder's scripts run with it on sys.path

POOLS = ("Prefill", "Decode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hostile_corpus(model: str) -> list[tuple]:
    """tests/fakes/hostile_requests.py's corpus (loaded from its file: the tests are no package
    this script can import)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "hostile_requests.py"
    spec = importlib.util.spec_from_file_location("hostile_requests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hostile_requests(model)


def rss_growth(samples: list[dict], starts: dict[int, int], warmup: int, min_span: int) -> list[dict]:
    """Per process (pid): its RSS after its first `warmup` requests (counted from `starts[pid]`,
    the request count when it started), as a least-squares slope in MiB per 10,000 requests;
    None where fewer than `min_span` requests remain after the warm-up. Where the samples carry
    `anon_bytes` (the private part), its slope too (`anon_mib_per_10k`): a decode replica's RSS
    also counts the pages of prefill replicas' caches it has read, which grow after a prefill
    replica is replaced (up to that cache's size) without being anyone's leak."""
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    rows = []
    for pid, series in by_pid.items():
        start = starts.get(pid, 0)
        warm = [s for s in series if s["requests"] - start >= warmup]
        row = {"deployment": series[0]["deployment"], "pid": pid, "from_request": start,
               "to_request": series[-1]["requests"], "num_samples": len(warm), "rss_first_mib": None,
               "rss_last_mib": None, "mib_per_10k": None, "anon_mib_per_10k": None}
        if warm:
            row.update(rss_first_mib=warm[0]["rss_bytes"] / 2**20, rss_last_mib=warm[-1]["rss_bytes"] / 2**20)
        span = warm[-1]["requests"] - warm[0]["requests"] if warm else 0
        if len(warm) >= 3 and span >= min_span:
            row["mib_per_10k"] = _slope_mib_per_10k(warm, "rss_bytes")
            if all("anon_bytes" in s for s in warm):
                row["anon_mib_per_10k"] = _slope_mib_per_10k(warm, "anon_bytes")
        rows.append(row)
    return sorted(rows, key=lambda r: (r["deployment"], r["from_request"]))


def _slope_mib_per_10k(samples: list[dict], key: str) -> float:
    xs, ys = [s["requests"] for s in samples], [s[key] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs) * 10_000 / 2**20


class Sampler:
    """Reads every known replica's RSS every `period_s` (a thread), tagged with the requests done."""

    def __init__(self, pids: dict[str, int], done: list[int], period_s: float):
        from pdserve.bench.soak import rss_parts

        self.pids, self.done, self.period_s, self._rss = dict(pids), done, period_s, rss_parts
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for deployment, pid in list(self.pids.items()):
                rss = self._rss(pid)
                if rss is not None:
                    self.samples.append({"requests": self.done[0], "deployment": deployment, "pid": pid,
                                         "rss_bytes": rss["rss"], "anon_bytes": rss["anon"],
                                         "shmem_bytes": rss["shmem"]})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000, help="requests in all (default %(default)s)")
    ap.add_argument("--kill-every", type=int, default=10_000,
                    help="SIGKILL one engine replica (prefill, decode, in turn) every this many requests; 0: never "
                         "(default %(default)s)")
    ap.add_argument("--kill-pools", default=",".join(POOLS), type=lambda text: text.split(","),
                    help="the pools whose replicas are killed, in turn (default %(default)s; one: the other pool's "
                         "replica lives through every kill, what its memory keeps of dead peers)")
    ap.add_argument("--config", help="a pdserve YAML config of a disaggregated app (default: "
                                     "pdserve.bench.soak.SOAK_CONFIG, the tiny model)")
    ap.add_argument("--concurrency", type=int, default=12, help="requests in flight at once (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the mix's seed")
    ap.add_argument("--mix", help="kinds and their shares, e.g. whole=1,stream=1 (default: "
                                  "pdserve.bench.soak.DEFAULT_MIX); one kind alone shows what it costs")
    ap.add_argument("--warmup", type=int, default=2000,
                    help="requests each process serves before its RSS counts (default %(default)s)")
    ap.add_argument("--rss-period-s", type=float, default=2.0, help="how often RSS is read (default %(default)s)")
    ap.add_argument("--out", default="soak.json", help="where the whole record goes (default %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (a log file)")
    args = ap.parse_args()
    if not args.kill_pools or set(args.kill_pools) - set(POOLS):
        ap.error(f"--kill-pools: name some of {', '.join(POOLS)}")

    import ray
    from ray import serve
    from tqdm import tqdm

    from pdserve.app import build, load_config, resolve_model
    from pdserve.bench import soak
    from pdserve.config import ServeConfig
    from pdserve.launch import ray_env

    config = load_config(args.config) if args.config else ServeConfig(**soak.SOAK_CONFIG)
    config = resolve_model(config)
    if config.mode != "disaggregated":
        sys.exit("--config: the soak runs against a disaggregated app")
    for name, value in ray_env(config, None).items():  # as `pdserve serve` starts Ray
        os.environ.setdefault(name, value)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="error",
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app, base, model = config.name, f"http://127.0.0.1:{port}", config.served_model_name
    record: dict = {"benchmark": "soak", "machine": machine_line(), "command": " ".join(["python", *sys.argv]),
                    "requests": args.requests, "kill_every": args.kill_every, "kill_pools": args.kill_pools,
                    "concurrency": args.concurrency, "seed": args.seed, "warmup": args.warmup, "mix": args.mix}
    try:
        serve.run(build(config), name=app, route_prefix="/")
        pids = {d: soak.replica_stats(app, d, num_calls=1)[0]["pid"] for d in (*POOLS, "Gateway")}
        done, kills, starts, num_unaccounted = [0], [], {pid: 0 for pid in pids.values()}, [0]
        sampler = Sampler(pids, done, args.rss_period_s)
        bar = tqdm(total=args.requests, disable=args.no_progress, smoothing=0.05, mininterval=1.0)

        def kill(at: int, deployment: str) -> None:  # a thread: the load goes on meanwhile
            t0 = time.monotonic()
            try:
                dead = soak.kill_replica(app, deployment)
                new = soak.wait_for_replacement(app, deployment, dead, timeout_s=300)
            except Exception as e:  # noqa: BLE001 - recorded; the end's accounting shows the rest
                kills.append({"at_request": at, "deployment": deployment, "error": repr(e)})
                return
            starts[new] = done[0]
            sampler.pids[deployment] = new
            kills.append({"at_request": at, "deployment": deployment, "killed_pid": dead, "new_pid": new,
                          "replaced_after_s": time.monotonic() - t0})

        killers: list[threading.Thread] = []

        def on_done(req, outcome) -> None:
            done[0] += 1
            bar.update(1)
            if outcome == soak.UNACCOUNTED:
                num_unaccounted[0] += 1
                bar.set_postfix_str(f"unaccounted {num_unaccounted[0]}", refresh=False)
            if args.kill_every and done[0] % args.kill_every == 0 and done[0] < args.requests:
                deployment = args.kill_pools[(done[0] // args.kill_every - 1) % len(args.kill_pools)]
                killers.append(threading.Thread(target=kill, args=(done[0], deployment), daemon=True))
                killers[-1].start()

        mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))} if args.mix else None
        plan = soak.plan_requests(args.requests, model, _hostile_corpus(model), seed=args.seed, mix=mix)
        result = asyncio.run(soak.drive(base, plan, args.concurrency, on_done))
        bar.close()
        for t in killers:
            t.join()
        sampler.stop()
        accounting, held = soak.wait_for_quiescence(app, config.transfer.lease_s + 30)
        decode = next(iter(soak.replica_stats(app, "Decode", num_calls=1)), {})  # the current replica's own counts
        record["decode_counts"] = {k: decode.get(k) for k in (
            "num_remote_prefills", "num_local_prefills", "num_resumed_requests", "num_failed_pulls",
            "num_preemptions", "num_aborted_requests")}
        growth = rss_growth(sampler.samples, starts, args.warmup, min_span=max(1000, args.warmup // 2))
        record.update(result=result.as_dict(), kills=kills, accounting=accounting, held=held, rss_growth=growth,
                      rss_samples=sampler.samples)
    finally:
        serve.shutdown()
        ray.shutdown()

    r = record["result"]
    print(f"\n{record['machine']}\n`{record['command']}`\n")
    print(f"{r['num_requests']} requests in {r['elapsed_s']:.0f} s ({r['num_requests'] / r['elapsed_s']:.1f}/s)\n")
    print("| outcome | requests |\n|---|---|")
    for outcome, n in r["counts"].items():
        print(f"| {outcome} | {n} |")
    print("\n| kind | " + " | ".join(soak.OUTCOMES) + " |\n|---|" + "---|" * len(soak.OUTCOMES))
    for kind, counts in r["by_kind"].items():
        print(f"| {kind} | " + " | ".join(str(counts.get(o, 0)) for o in soak.OUTCOMES) + " |")
    if record["kills"]:
        print("\n| kill at request | deployment | replaced after (s) |\n|---|---|---|")
        for k in record["kills"]:
            print(f"| {k['at_request']} | {k['deployment']} | "
                  f"{k.get('replaced_after_s', float('nan')):.1f}{' ' + k['error'] if 'error' in k else ''} |")
    print(f"\n| process | requests | RSS after warm-up (MiB) | last (MiB) | growth per 10,000 requests (MiB) "
          "| private (anon) growth per 10,000 (MiB) |\n|---|---|---|---|---|---|")
    for g in record["rss_growth"]:
        first, last, slope, anon = g["rss_first_mib"], g["rss_last_mib"], g["mib_per_10k"], g["anon_mib_per_10k"]
        print(f"| {g['deployment']} pid {g['pid']} | {g['from_request']}-{g['to_request']} | "
              f"{'-' if first is None else f'{first:.1f}'} | {'-' if last is None else f'{last:.1f}'} | "
              f"{'-' if slope is None else f'{slope:+.2f}'} | {'-' if anon is None else f'{anon:+.2f}'} |")
    print(f"\nthe last decode replica's counts: {record.get('decode_counts')}")
    print("\nheld at the end: " + ("nothing" if not record["held"] else "; ".join(record["held"])))
    for line in r["unaccounted"]:
        print(f"unaccounted: {line}")
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: v for k, v in record.items() if k not in ("rss_samples", "accounting")}, default=str))
    return 1 if record["held"] or r["counts"][soak.UNACCOUNTED] else 0


if __name__ == "__main__":
    sys.exit(main())
