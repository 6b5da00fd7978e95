"""`pdserve status`: pools, replicas and where they run, queue depth, KV usage, prefix hit rate and
transfer rate, from a running cluster (Ray Serve's states plus each replica's status line)."""

from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("status", help="show the running pdserve applications, pools and replicas",
                       description="Connect to a running Ray cluster and show each pdserve application's pools: "
                                   "Ray Serve's state and replica counts, and per replica its node, accelerator, "
                                   "waiting requests and prompt tokens, running sequences, KV-cache usage, prefix "
                                   "hit rate and KV pull rate (replicas refresh these every "
                                   "telemetry.metrics_period_s).")
    s.add_argument("--address", default="auto",
                   help="Ray cluster to read (default: auto, the cluster this machine runs or belongs to)")
    s.add_argument("--app", help="only this Ray Serve application")
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    s.set_defaults(handler=_status)


def _status(args) -> int:
    import ray

    from pdserve.telemetry.status import collect_status, format_status

    try:
        ray.init(address=args.address, log_to_driver=False, logging_level="error")
    except ConnectionError as e:
        print(f"no Ray cluster at {args.address!r} ({e}); start one with `pdserve serve`, or pass --address. "
              "A cluster with Ray's token authentication (the Helm chart's default) also wants RAY_AUTH_MODE=token "
              "and its RAY_AUTH_TOKEN: run `pdserve status` inside the head pod, which has both (NOTES.txt says how)")
        return 1
    try:
        while True:
            status = collect_status(args.app)
            print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
            print()
    except KeyboardInterrupt:
        return 0
    finally:
        ray.shutdown()
