"""What a request body costs the gateway's event loop, parsed on the gateway's thread (before) or
first vetted in a process of its own (`pdserve.gateway.body_vetter`, after), side by side.

    python benchmarks/body_vetting.py --repeats 5

The event loop runs a ticker (`asyncio.sleep(0.001)` in a loop, as an SSE writer waits for its
next token) while each body goes through the gateway's body stage: before, `parse_json_object`,
`check_counts` and the completions model's validation on a worker thread, as the gateway did for
every body; after, `BodyVetter.vet` and then, for a body the bounds accept, the same on the thread
with the body parsed a piece at a time (`parse_json_object_in_pieces`, as the gateway parses the
bodies it vetted; the model validates many token-id prompts one list at a time). Reported per body: the
largest gap between two ticks (what every stream on the gateway would have waited) and the time
to the verdict, medians over --repeats, with a run of the ticker alone as the floor. The bounds
are the gateway's defaults for a model of --max-model-len tokens whose longest token piece is
--chars-per-token characters. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from machine import machine_line  # this folder's scripts run with it on sys.path


def bodies(max_chars: int) -> dict[str, bytes]:
    mib4 = 4 << 20
    return {
        "4 MiB of empty prompts `[[],[],...]` (400)": b'{"prompt": [' + b",".join([b"[]"] * (mib4 // 3 - 10)) + b"]}",
        "4 MiB prompt of token ids (400)": b'{"prompt": [' + b",".join([b"5"] * (mib4 // 2 - 10)) + b"]}",
        "4 MiB text prompt (400)": json.dumps({"prompt": "x" * (mib4 - 100)}).encode(),
        "50,000 prompts (400)": json.dumps({"prompt": [[5]] * 50_000}).encode(),
        "256 prompts of 8,000 token ids (served: near the most the bounds accept)":
            b'{"prompt": [' + b",".join([b"[" + b",".join([b"5"] * 8000) + b"]"] * 256) + b"]}",
        "text prompt at the character bound (served)": json.dumps({"prompt": "hello " * (max_chars // 6)}).encode(),
        "16 KiB text prompt (served, not vetted)": json.dumps({"prompt": "x" * ((16 << 10) - 20)}).encode(),
    }


async def measure(handle, body: bytes) -> tuple[float, float, str]:
    """(largest tick gap ms, time to verdict ms, verdict) for `handle(body)` beside the ticker."""
    gaps, stop = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    gaps.clear()
    start = time.perf_counter()
    try:
        await handle(body)
        verdict = "ok"
    except Exception as e:  # noqa: BLE001
        verdict = type(e).__name__
    took = time.perf_counter() - start
    await asyncio.sleep(0.005)  # a tick after the verdict: the GIL's hold may end with it
    stop.set()
    await task
    return max(gaps) * 1e3, took * 1e3, verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--chars-per-token", type=int, default=16)
    args = ap.parse_args()

    from pdserve.config import GatewayConfig
    from pdserve.gateway.body_vetter import BodyVetter
    from pdserve.gateway.bounds import RequestBounds
    from pdserve.gateway.protocol import CompletionRequest
    from pdserve.gateway.request_body import parse_json_object, parse_json_object_in_pieces

    tokenizer_json = {"model": {"vocab": {"x" * args.chars_per_token: 0}}}
    bounds = RequestBounds.of(GatewayConfig(), tokenizer_json, args.max_model_len)
    thread = ThreadPoolExecutor(1)
    vetter = BodyVetter(bounds)

    def stage(parse, body: bytes) -> None:
        data = parse(body)
        bounds.check_counts(data)
        CompletionRequest.model_validate(data)

    async def before(body: bytes) -> None:
        await asyncio.get_running_loop().run_in_executor(thread, stage, parse_json_object, body)

    async def after(body: bytes) -> None:
        await vetter.vet(body, 30.0)
        await asyncio.get_running_loop().run_in_executor(thread, stage, parse_json_object_in_pieces, body)

    async def idle(body: bytes) -> None:
        await asyncio.sleep(0.3)

    async def run() -> dict:
        await vetter.vet(b"{}", 30.0)  # started
        out = {"ticker alone, 0.3 s": {"idle": [await measure(idle, b"") for _ in range(args.repeats)]}}
        for name, body in bodies(bounds.max_prompt_chars).items():
            out[name] = {"before": [], "after": [], "bytes": len(body)}
            for _ in range(args.repeats):  # interleaved
                out[name]["before"].append(await measure(before, body))
                out[name]["after"].append(await measure(after, body))
        vetter.close()
        return out

    started = time.perf_counter()
    results = asyncio.run(run())
    print(f"\n{machine_line()}\nbounds: gateway defaults, max_model_len {args.max_model_len}, "
          f"{bounds.max_prompt_chars} characters a prompt; medians of {args.repeats}\n")
    print("| body | bytes | largest tick gap ms, before | after | time to verdict ms, before | after | verdict |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for name, r in results.items():
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), v[0][2])
               for k, v in r.items() if k != "bytes"}
        summary[name] = med
        if "idle" in med:
            print(f"| {name} | - | {med['idle'][0]:.1f} | - | - | - | - |")
            continue
        b, a = med["before"], med["after"]
        print(f"| {name} | {r['bytes']:,} | {b[0]:.1f} | {a[0]:.1f} | {b[1]:.1f} | {a[1]:.1f} | {a[2]} |")
    print(json.dumps({"bench": "body_vetting", "machine": machine_line(), "repeats": args.repeats,
                      "max_model_len": args.max_model_len, "max_prompt_chars": bounds.max_prompt_chars,
                      "results": results, "medians": summary, "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
