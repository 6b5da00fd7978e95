"""What a kept, idle KV connection costs the prefill replica: an exporter process's CPU time and
wakeups (voluntary context switches, summed over its threads) per second of an idle window, with
no connection open (the baseline, in the same run) and with one importer's connection kept after a
pull, as a decode replica keeps it between pulls. A waiting receive that polls, or UCX's progress
thread woken every millisecond, shows up here as CPU time and wakeups per second; a connection
that only waits costs about what no connection does.

    python benchmarks/kvtransfer_idle.py [--window-s 2] [--repeats 5]

Each state: one warm-up window, then `--repeats` windows, their median. The states run one after
the other (alternating them would close and reopen the connection between windows). Prints a
markdown table and one JSON line. (This was a budget inside
tests/integration/kvtransfer/test_ucx_transfer.py, now test_network_transfer.py: under 0.15 s of CPU and 60 wakeups in 0.3 s.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("UCX_TLS", "tcp")

LAYOUT = dict(model_id="bench-idle", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
NUM_BLOCKS = 64


def _wakeups() -> int:
    total = 0
    for thread_id in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread_id}/status") as f:
                total += int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except OSError:  # the thread ended meanwhile
            pass
    return total


def _exporter(commands, replies) -> None:
    """The prefill side: a UCX exporter over a small cache; answers ("export",), ("usage",),
    ("open",) and ("stop",)."""
    import torch

    from pdserve.engine.kv_cache import BlockPool
    from pdserve.kvtransfer.protocol import KVLayout
    from pdserve.kvtransfer.ucx_backend import UCXExporter

    kv = torch.randn(LAYOUT["num_layers"], 2, NUM_BLOCKS, 16, 4, 64)
    pool = BlockPool(NUM_BLOCKS, 16)
    exporter = UCXExporter("idle", kv, KVLayout(**LAYOUT), pool.incref, pool.free, lease_s=600,
                           idle_timeout_s=3600)
    replies.put(exporter.address)
    while (cmd := commands.get())[0] != "stop":
        if cmd[0] == "export":
            replies.put(exporter.export("r", pool.allocate(4), 64).to_dict())
        elif cmd[0] == "usage":
            replies.put((time.process_time(), _wakeups()))
        elif cmd[0] == "open":
            replies.put(exporter.num_open_connections)
    exporter.close()


def _windows(call, window_s: float, repeats: int) -> tuple[float, float]:
    """Median CPU ms and wakeups per second of the exporter over `repeats` idle windows (after one
    warm-up window)."""
    cpu, woken = [], []
    for i in range(repeats + 1):
        cpu_0, woken_0 = call("usage")
        time.sleep(window_s)  # the window being measured: nothing happens in it, on purpose
        cpu_1, woken_1 = call("usage")
        if i:
            cpu.append((cpu_1 - cpu_0) / window_s * 1e3)
            woken.append((woken_1 - woken_0) / window_s)
    return statistics.median(cpu), statistics.median(woken)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from pdserve.kvtransfer import protocol as p
    from pdserve.kvtransfer.ucx_backend import UCXImporter

    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_exporter, args=(commands, replies), daemon=True)
    proc.start()

    def call(*cmd):
        commands.put(cmd)
        return replies.get(timeout=60)

    importer = None
    try:
        replies.get(timeout=120)  # its address: it is up
        results = {"no connection": _windows(call, args.window_s, args.repeats)}
        importer = UCXImporter(torch.zeros(LAYOUT["num_layers"], 2, 8, 16, 4, 64), p.KVLayout(**LAYOUT),
                               idle_s=3600)
        importer.pull(p.KVHandle.from_dict(call("export")), [0, 1, 2, 3])  # opens the connection, kept
        assert call("open") == 1, "the pull's connection was not kept"
        results["one kept connection"] = _windows(call, args.window_s, args.repeats)
        assert call("open") == 1, "the connection was dropped during the windows"
    finally:
        if importer is not None:
            importer.close()
        commands.put(("stop",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    print(f"| exporter state | CPU ms per s (median of {args.repeats} x {args.window_s:g} s) | wakeups per s |")
    print("|---|---:|---:|")
    for state, (cpu_ms, woken) in results.items():
        print(f"| {state} | {cpu_ms:.1f} | {woken:.0f} |")
    print(json.dumps({"benchmark": "kvtransfer_idle", "window_s": args.window_s, "repeats": args.repeats,
                      **{state.replace(" ", "_"): {"cpu_ms_per_s": round(c, 2), "wakeups_per_s": round(w, 1)}
                         for state, (c, w) in results.items()}}))


if __name__ == "__main__":
    main()
