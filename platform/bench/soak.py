"""The soak's load and its ledger (#42): a seeded mix of what a server meets over a long run, sent
over HTTP at bounded concurrency, each request's outcome classified; and every replica's accounting,
read at the end and checked for anything still held.

The mix: completions and chat completions, whole and streamed, some prompts sharing a prefix with
others (prefix-cache hits, local prefill on the decode replica) and some not (remote prefill and
a KV pull), greedy and seeded sampling, `n=2`; clients that cancel a stream after a few chunks,
clients that give up after a short timeout, and hostile bodies from a corpus (entries
`(name, path, body, status, ...)`, as tests/fakes/hostile_requests.py's), each expecting its 4xx.

Outcomes: `completed` (every choice finished, no error), `cancelled` (the client left mid-stream,
as planned), `client_timeout` (the client gave up at its planned timeout), `retryable` (503, 504 or
429, or an in-stream error of type service_unavailable or timeout: what a replica's death or a
deadline gives), `rejected` (a hostile body got the status its corpus entry names), and
`unaccounted`: anything else (a 500, a valid request refused, a broken connection, a stream that
ended without a finish, a request that outlived `max_request_s`). A soak passes with none.

In: the app's base URL and model name, a plan (`plan_requests`), a callback after each request.
Out: a `SoakResult`. `read_accounting` and `wait_for_quiescence` read the replicas through the
app's Serve handles (from a Ray driver connected to its cluster); `kill_replica` sends SIGKILL to
one (same host). This module does not start the app or sample memory: benchmarks/soak.py and
tests/e2e/test_soak.py do.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

COMPLETED, CANCELLED, CLIENT_TIMEOUT, RETRYABLE, REJECTED, UNACCOUNTED = (
    "completed", "cancelled", "client_timeout", "retryable", "rejected", "unaccounted")
OUTCOMES = (COMPLETED, CANCELLED, CLIENT_TIMEOUT, RETRYABLE, REJECTED, UNACCOUNTED)
RETRYABLE_STATUSES = (429, 503, 504)
RETRYABLE_ERROR_TYPES = ("service_unavailable", "timeout")

# Kind -> share of the requests (normalised).
DEFAULT_MIX = {"whole": 0.30, "stream": 0.30, "cancel": 0.16, "timeout": 0.08, "hostile": 0.04,
               "shared_whole": 0.06, "shared_stream": 0.06}
WORDS = ("the of and to in is was for on that with as by at from his her they this which were are be had one "
         "all their has new more time when would about there can other into only after first over also may where "
         "these many through most such some people before between world during city state under school system "
         "group water light house river north south east west power music model token cache block serve prefill "
         "decode request stream router engine batch queue paris london tokyo cairo lima oslo rome delhi seoul "
         "quick brown fox jumps lazy dog red green blue yellow black white small large early late").split()


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # a DEFAULT_MIX key
    path: str  # /v1/completions or /v1/chat/completions
    body: dict | bytes  # keyword arguments of the openai client's create(), or a hostile body's bytes
    cancel_after_chunks: int = 0  # > 0: the client closes the stream after this many chunks
    timeout_s: float | None = None  # the client gives up after this long (a planned timeout)
    expected_status: int | None = None  # a hostile body's answer
    name: str = ""  # a hostile body's corpus entry


@dataclass
class SoakResult:
    counts: Counter = field(default_factory=Counter)  # outcome -> requests
    by_kind: dict[str, Counter] = field(default_factory=dict)  # kind -> outcome -> requests
    unaccounted: list[str] = field(default_factory=list)  # the first few, described
    elapsed_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(self.counts.values())

    def add(self, req: SoakRequest, outcome: str, detail: str) -> None:
        self.counts[outcome] += 1
        self.by_kind.setdefault(req.kind, Counter())[outcome] += 1
        if outcome == UNACCOUNTED and len(self.unaccounted) < 20:
            self.unaccounted.append(f"#{req.index} {req.kind}{' ' + req.name if req.name else ''}: {detail}")

    def as_dict(self) -> dict:
        return {"num_requests": self.num_requests, "counts": {o: self.counts.get(o, 0) for o in OUTCOMES},
                "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())}, "unaccounted": self.unaccounted,
                "elapsed_s": self.elapsed_s}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def plan_requests(num_requests: int, model: str, hostile: Sequence[tuple] = (), seed: int = 0,
                  mix: dict[str, float] | None = None, num_prefixes: int = 8) -> Iterator[SoakRequest]:
    """`num_requests` requests drawn from `mix` (seeded). Prompts stay under ~160 tokens and outputs
    under 200 (a context of a few hundred tokens, as the hostile corpus assumes, holds them)."""
    rng = random.Random(seed)
    mix = dict(mix or DEFAULT_MIX)
    if not hostile:
        mix.pop("hostile", None)
    kinds, weights = list(mix), list(mix.values())
    prefixes = [_words(random.Random(seed * 1000 + i), 30) for i in range(num_prefixes)]
    corpus = [(name, path, body if isinstance(body, bytes) else json.dumps(body).encode(), status)
              for name, path, body, status, *_ in hostile]
    for i in range(num_requests):
        kind = rng.choices(kinds, weights)[0]
        if kind == "hostile":
            name, path, data, status = corpus[i % len(corpus)]
            yield SoakRequest(i, kind, path, data, expected_status=status, name=name)
            continue
        is_chat = rng.random() < 0.3
        prompt = (f"{rng.choice(prefixes)} {_words(rng, rng.randint(2, 12))}" if kind.startswith("shared")
                  else _words(rng, rng.randint(4, 90)))
        body: dict = {"model": model, "max_tokens": rng.randint(2, 40), "stream": kind in ("stream", "cancel",
                                                                                          "shared_stream")}
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(2**31))
        else:
            body["temperature"] = 0
        if kind in ("whole", "stream") and rng.random() < 0.1:
            body["n"] = 2
        cancel_after, timeout_s = 0, None
        if kind == "cancel":  # long enough that the client leaves mid-stream
            body.update(max_tokens=rng.randint(60, 200), extra_body={"ignore_eos": True})
            cancel_after = rng.randint(1, 6)
        elif kind == "timeout":  # long enough that the client's timeout comes first
            body.update(max_tokens=rng.randint(100, 200), stream=rng.random() < 0.5, extra_body={"ignore_eos": True})
            timeout_s = rng.uniform(0.02, 0.5)
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if is_chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        yield SoakRequest(i, kind, "/v1/chat/completions" if is_chat else "/v1/completions", body, cancel_after,
                          timeout_s)


def classify_status(status: int, is_hostile: bool, expected: int | None = None) -> str:
    if is_hostile and status == expected:
        return REJECTED
    if status in RETRYABLE_STATUSES:
        return RETRYABLE
    return COMPLETED if status == 200 and not is_hostile else UNACCOUNTED


def classify_error_body(error) -> str:
    """An in-stream error (the `error` object of an SSE event): retryable or not."""
    kind = error.get("type") if isinstance(error, dict) else None
    return RETRYABLE if kind in RETRYABLE_ERROR_TYPES else UNACCOUNTED


async def _send_valid(client, req: SoakRequest) -> tuple[str, str]:
    import openai

    create = client.chat.completions.create if req.path.endswith("chat/completions") else client.completions.create
    body = dict(req.body)
    num_choices = body.get("n", 1)
    try:
        if not body["stream"]:
            answer = await create(**body)
            if len(answer.choices) == num_choices and all(c.finish_reason for c in answer.choices):
                return COMPLETED, ""
            return UNACCOUNTED, f"{len(answer.choices)} choices, finishes {[c.finish_reason for c in answer.choices]}"
        finished: set[int] = set()
        num_chunks = 0
        async with await create(**body) as stream:
            async for chunk in stream:
                num_chunks += 1
                finished.update(c.index for c in chunk.choices if c.finish_reason)
                if req.cancel_after_chunks and num_chunks >= req.cancel_after_chunks and len(finished) < num_choices:
                    return CANCELLED, ""
        if len(finished) == num_choices:
            return COMPLETED, ""
        return UNACCOUNTED, f"the stream ended after {num_chunks} chunks with {len(finished)} of {num_choices} finished"
    except openai.APIStatusError as e:
        return classify_status(e.status_code, False), f"HTTP {e.status_code}: {str(e)[:200]}"
    except openai.APIConnectionError as e:
        return UNACCOUNTED, f"{type(e).__name__}: {e!r}"[:300]
    except openai.APIError as e:  # an error event in the stream
        return classify_error_body(e.body), f"in-stream error: {str(e.body)[:200]}"


async def _send_hostile(session, base_url: str, req: SoakRequest) -> tuple[str, str]:
    import aiohttp

    try:
        async with session.post(base_url + req.path, data=req.body,
                                headers={"Content-Type": "application/json"}) as r:
            text = await r.text(errors="replace")
            return classify_status(r.status, True, req.expected_status), f"HTTP {r.status}: {text[:200]}"
    except aiohttp.ClientError as e:
        return UNACCOUNTED, f"{type(e).__name__}: {e!r}"[:300]


async def drive(base_url: str, model_requests: Iterable[SoakRequest], concurrency: int = 12,
                on_done: Callable[[SoakRequest, str], None] | None = None, api_key: str = "unused",
                max_request_s: float = 120.0) -> SoakResult:
    """Send every request, at most `concurrency` at once; `on_done(request, outcome)` after each
    (on this event loop: it must not block). A request still unanswered after `max_request_s`
    (other than a planned timeout) is unaccounted: something hung."""
    import aiohttp
    import openai

    result, start = SoakResult(), time.perf_counter()
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=max_request_s)
    requests = iter(model_requests)

    async def one(session, req: SoakRequest) -> tuple[str, str]:
        send = (_send_hostile(session, base_url, req) if req.kind == "hostile" else _send_valid(client, req))
        limit = req.timeout_s if req.timeout_s is not None else max_request_s
        try:
            return await asyncio.wait_for(send, limit)
        except asyncio.TimeoutError:
            if req.timeout_s is not None:
                return CLIENT_TIMEOUT, ""
            return UNACCOUNTED, f"no answer within {max_request_s} s"

    async def worker(session) -> None:
        for req in requests:  # one shared iterator: each worker takes the next request
            outcome, detail = await one(session, req)
            result.add(req, outcome, detail)
            if on_done is not None:
                on_done(req, outcome)

    timeout = aiohttp.ClientTimeout(total=max_request_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        finally:
            await client.close()
    result.elapsed_s = time.perf_counter() - start
    return result


# The replicas' accounting: what each must hold once nothing runs. Engine replicas: no KV block in
# use (free cached blocks count as free), no unfinished request, no lease or open read (prefill),
# no open pull or in-flight request (decode); output connections at most one per gateway replica.
# Gateways: no sequence waiting for outputs, no call still ending; at most one output connection
# per decode replica.
ZERO_FIELDS = ("num_unfinished_requests", "num_kv_leases", "num_open_kv_reads", "num_open_kv_pulls",
               "num_in_flight_requests", "num_pending_sequences", "num_call_tails")


def replica_stats(app: str, deployment: str, num_calls: int = 8) -> list[dict]:
    """Each replica's stats (several calls at once: the handle's router spreads them over the
    replicas), one per pid; replicas that do not answer are left out."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    responses = [handle.stats.remote() for _ in range(num_calls)]
    by_pid = {}
    for response in responses:
        try:
            stats = response.result(timeout_s=30)
        except Exception:  # noqa: BLE001 - a replica that just died: the others still answer
            continue
        by_pid[stats["pid"]] = stats
    return list(by_pid.values())


def read_accounting(app: str, pools: Sequence[str] = ("Prefill", "Decode"), gateway: str = "Gateway") -> dict:
    """deployment -> its replicas' accounting (the fields `held` checks, plus pid and blocks)."""
    out = {}
    for deployment in (*pools, gateway):
        rows = []
        for s in replica_stats(app, deployment):
            row = {"pid": s["pid"], **{k: s[k] for k in ZERO_FIELDS if k in s}}
            if "num_kv_blocks" in s:
                row["num_used_kv_blocks"] = s["num_kv_blocks"] - s["num_free_kv_blocks"]
            for key in ("num_output_connections", "num_mapped_kv_caches"):
                if key in s:
                    row[key] = s[key]
            rows.append(row)
        out[deployment] = rows
    return out


def held(accounting: dict, gateway: str = "Gateway", decode: str = "Decode", prefill: str = "Prefill") -> list[str]:
    """What the replicas still hold that they should not, once nothing runs (empty: nothing): a
    connection per peer and a mapped cache per live prefill replica are allowed."""
    num_gateways, num_decodes = len(accounting.get(gateway, [])), len(accounting.get(decode, []))
    problems = []
    for deployment, rows in accounting.items():
        for row in rows:
            for key, value in row.items():
                if key == "pid" or not value:
                    continue
                if key == "num_output_connections":
                    limit = num_decodes if deployment == gateway else num_gateways
                    if value <= limit:
                        continue
                if key == "num_mapped_kv_caches" and value <= len(accounting.get(prefill, [])):
                    continue
                problems.append(f"{deployment} pid {row['pid']}: {key} = {value}")
    return problems


def wait_for_quiescence(app: str, timeout_s: float, pools: Sequence[str] = ("Prefill", "Decode"),
                        gateway: str = "Gateway", poll_s: float = 0.5) -> tuple[dict, list[str]]:
    """Poll the accounting until nothing is held or `timeout_s` passes (a lease of a dead decode
    replica is held until it expires: give at least `transfer.lease_s`). Returns the last reading
    and what it still held. Every pool must answer: a pool with no replica is held too."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounting = read_accounting(app, pools, gateway)
        problems = held(accounting, gateway) + [f"{d}: no replica answered" for d, rows in accounting.items() if not rows]
        if not problems or time.monotonic() > deadline:
            return accounting, problems
        time.sleep(poll_s)


def kill_replica(app: str, deployment: str) -> int:
    """SIGKILL one replica of `deployment` (the process its stats name: this host only); its pid."""
    [stats, *_] = replica_stats(app, deployment, num_calls=1)
    os.kill(stats["pid"], signal.SIGKILL)
    return stats["pid"]


def wait_for_replacement(app: str, deployment: str, dead_pid: int, timeout_s: float) -> int:
    """The pid of a replica of `deployment` other than `dead_pid`, once one answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [s["pid"] for s in replica_stats(app, deployment, num_calls=2) if s["pid"] != dead_pid]
        if pids:
            return pids[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replica of {deployment} came back within {timeout_s} s")
        time.sleep(0.5)


_RSS_FIELDS = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def rss_parts(pid: int) -> dict[str, int] | None:
    """A process's resident set in bytes (Linux /proc), None once it is gone: `rss` in all, `anon`
    its private memory (where a leak grows), `shmem` the shared memory it has touched (its own KV
    cache, and the prefill replicas' caches a decode replica reads from: as large as those caches
    at most, and gone with the mapping), `file` mapped files."""
    parts = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                fields = line.split()
                key = _RSS_FIELDS.get(fields[0]) if fields else None
                if key:
                    parts[key] = int(fields[1]) * 1024
    except OSError:
        return None
    return parts if "rss" in parts else None


def rss_bytes(pid: int) -> int | None:
    """A process's resident set (Linux /proc), None once it is gone."""
    parts = rss_parts(pid)
    return None if parts is None else parts["rss"]


# The disaggregated tiny app a soak runs against by default (benchmarks/soak.py, tests/e2e/test_soak.py):
# one prefill and one decode replica of one core each; prompts of 24 uncached tokens and more are
# prefilled remotely (shared prefixes cached on the decode replica make the rest local); a context
# of 384 tokens (what the hostile corpus assumes); the KV cache small enough that the mix preempts.
SOAK_CONFIG = {
    "name": "soak",
    "engine": {"num_threads": 1, "num_kv_blocks": 512, "block_size": 8, "max_model_len": 384, "max_num_seqs": 32,
               "max_num_batched_tokens": 512},
    "prefill": {"ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 2.0},
    "decode": {"ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 2.0},
    "transfer": {"host": "127.0.0.1", "lease_s": 20},
    "gateway": {"request_timeout_s": 60},
}
