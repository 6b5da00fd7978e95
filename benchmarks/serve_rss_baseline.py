"""What Ray Serve itself leaves in a replica per request (#42's soak baseline): two replicas shaped
like pdserve's pools that do no work: a decode-shaped one takes a `GenerateRequest` by a streaming
handle call, makes a unary handle call to a prefill-shaped one for its first `RequestOutput` and
yields the rest itself; their RSS read from /proc as the requests go on.

    python benchmarks/serve_rss_baseline.py                      # 30,000 requests, 4,000 of warm-up
    python benchmarks/serve_rss_baseline.py --requests 10000 --outputs 8

The soak (benchmarks/soak.py) measures each pdserve replica's RSS growth per 10,000 requests; this
gives the same figure for Serve's own path with nothing of pdserve's engine, transfer or output
connection behind it, on the same machine, so the two can be told apart. Prints a table and one
JSON line (the slope is the least-squares one `soak.py` reports, after the warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from machine import machine_line  # this folder's scripts run with it on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30000, help="streaming calls (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=4000, help="calls before RSS counts (default %(default)s)")
    ap.add_argument("--outputs", type=int, default=5, help="outputs each call yields (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="calls in flight (default %(default)s)")
    ap.add_argument("--sample-every", type=int, default=1000, help="calls between RSS reads (default %(default)s)")
    args = ap.parse_args()

    import ray
    from ray import serve

    from pdserve.bench.soak import rss_bytes
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.protocol import GenerateRequest
    from soak import rss_growth

    @serve.deployment(max_ongoing_requests=64)
    class Prefill:  # the prefill pool's shape: a unary call per request
        def pid(self) -> int:
            return os.getpid()

        async def prefill(self, req: GenerateRequest) -> RequestOutput:
            return RequestOutput(req.request_id, [1], "x", False, num_prompt_tokens=len(req.prompt_token_ids))

    @serve.deployment(max_ongoing_requests=64)
    class Decode:  # the decode pool's shape: a stream per request, and a client of the prefill pool
        def __init__(self, prefill) -> None:
            self.prefill = prefill

        def pid(self) -> int:
            return os.getpid()

        async def generate(self, req: GenerateRequest, n: int):
            yield await self.prefill.prefill.remote(req)
            for i in range(1, n):
                yield RequestOutput(req.request_id, [i], "x", i == n - 1, num_prompt_tokens=len(req.prompt_token_ids),
                                   num_output_tokens=i + 1)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Decode.bind(Prefill.bind()), name="rss-baseline", route_prefix=None)
        pids = {"Decode": handle.pid.remote().result()}
        pids["Prefill"] = serve.get_deployment_handle("Prefill", "rss-baseline").pid.remote().result()
        stream = handle.options(stream=True).generate
        params = SamplingParams(max_tokens=args.outputs, temperature=0.0)
        samples, done = [], 0

        async def one(i: int) -> None:
            req = GenerateRequest(f"r{i}", [5 + (i + j) % 200 for j in range(40 + i % 60)], params)
            async for _ in stream.remote(req, args.outputs):
                pass

        async def drive() -> float:
            started = time.monotonic()
            queue = iter(range(args.requests))

            async def worker() -> None:
                nonlocal done
                for i in queue:
                    await one(i)
                    done += 1
                    if done % args.sample_every == 0:
                        samples.extend({"pid": pid, "deployment": name, "requests": done, "rss_bytes": rss_bytes(pid)}
                                       for name, pid in pids.items())
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return time.monotonic() - started

        seconds = asyncio.run(drive())
        growth = rss_growth(samples, {pid: 0 for pid in pids.values()}, args.warmup,
                            min_span=max(1000, args.warmup // 2))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"machine: {machine_line()}")
    print(f"{args.requests} streaming calls of {args.outputs} outputs (the first from a unary call to the "
          f"prefill-shaped replica), {args.concurrency} in flight, in {seconds:.0f} s ({args.requests / seconds:.0f}/s)")
    names = list(pids)
    print("| requests done | " + " | ".join(f"{n} RSS (MiB)" for n in names) + " |\n|---|" + "---|" * len(names))
    rows = [samples[i:i + len(names)] for i in range(0, len(samples), len(names))]
    for row in rows[::max(1, len(rows) // 10)]:
        print(f"| {row[0]['requests']:,} | " + " | ".join(f"{s['rss_bytes'] / 2**20:.2f}" for s in row) + " |")
    for g in growth:
        print(f"{g['deployment']} RSS after {args.warmup:,} calls: {g['rss_first_mib']:.2f} -> {g['rss_last_mib']:.2f} "
              f"MiB, {g['mib_per_10k']:.2f} MiB per 10,000 calls")
    print(json.dumps({"requests": args.requests, "outputs": args.outputs, "seconds": seconds, "rss_growth": growth}))


if __name__ == "__main__":
    main()
