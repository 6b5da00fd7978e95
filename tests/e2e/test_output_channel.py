"""Outputs over the engine replicas' output connections to the gateway (pdserve.output),
through HTTP with the official client: many concurrent streams arrive whole and in order with
one finish each, clients that leave free their KV while the streams beside them go on, and a
gateway replica killed mid-stream leaves nothing held on the engine replica."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from pdserve.config import ServeConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from .conftest import ENGINE, App, wait_until_serving

PROMPT = ("In a distant land, the old lighthouse keeper wrote letters to the sea every evening, "
          "and the sea, patient as ever, answered with the tide")  # long enough for remote prefill


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, block_size=ENGINE["block_size"], num_kv_blocks=256)


def engine_pool(app: App) -> str:
    return app.pools[-1]  # Decode or Unified: the replica that streams


def connect(app: App, timeout_s: float = 30.0) -> None:
    """One request, then wait for the gateway's output connection to the engine replica."""
    app.client.completions.create(model=app.model, prompt="warm up", max_tokens=2)
    deadline = time.monotonic() + timeout_s
    while app.stats(engine_pool(app))["num_output_connections"] < 1:
        assert time.monotonic() < deadline, "the gateway never connected to the engine replica"
        time.sleep(0.2)


def test_concurrent_streams_arrive_whole_and_in_order(app, offline):
    connect(app)
    prompts = [f"{PROMPT} {i}" if i % 3 == 0 else f"story {i}:" for i in range(32)]
    expected = [c.text for c in offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                         ignore_eos=True))]

    async def one(client, prompt):
        stream = await client.completions.create(model=app.model, prompt=prompt, max_tokens=16, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks)

    async def main():  # a client of this event loop (app.aclient's connections belong to another test's)
        async with openai.AsyncOpenAI(base_url=f"{app.base}/v1", api_key=app.api_key, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert app.stats(engine_pool(app))["num_output_connections"] >= 1  # they went over it
    stats = app.wait_for_idle()
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_unfinished_requests"] == 0
               for s in stats.values()), stats


def test_clients_that_leave_free_their_kv_and_others_go_on(app, offline):
    connect(app)
    [expected] = [c.text for c in offline.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0,
                                                                           ignore_eos=True))]
    headers = {"Authorization": f"Bearer {app.api_key}"}

    def leaver(i):
        body = {"model": app.model, "prompt": f"{PROMPT} {i}", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with requests.post(f"{app.base}/v1/completions", json=body, stream=True, timeout=60, headers=headers) as r:
            lines = r.iter_lines()
            return sum(1 for _ in zip(range(6), lines))

    def stayer():
        r = app.client.completions.create(model=app.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in r)

    with ThreadPoolExecutor(7) as pool:
        staying = pool.submit(stayer)
        assert list(pool.map(leaver, range(6))) == [6] * 6
        assert staying.result() == expected
    stats = app.wait_for_idle(30)
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and s.get("num_kv_leases", 0) == 0
               and s["num_unfinished_requests"] == 0 for s in stats.values()), stats


def test_a_gateway_replica_killed_mid_stream_leaks_nothing(serve_apps, tiny_llama):
    import ray
    from ray import serve

    from pdserve.app import build

    name = "gwkill"
    cfg = ServeConfig(name=name, model=tiny_llama, engine=ENGINE, mode="colocated",
                      decode={"ray_actor_options": {"num_cpus": 0.2}})
    serve.run(build(cfg), name=name, route_prefix=f"/{name}")
    app = App(name, f"{serve_apps['base']}/{name}", "tiny-llama", "unused", ["Unified"])
    try:
        connect(app)
        [gateway] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith(f"SERVE_REPLICA::{name}#Gateway#")]
        victim = ray.get_actor(gateway["name"], namespace=gateway["namespace"])

        def stream(i):
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
            try:
                with requests.post(f"{app.base}/v1/completions", json=body, stream=True, timeout=60) as r:
                    return sum(1 for _ in r.iter_lines())
            except requests.RequestException:
                return -1

        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, i) for i in range(4)]
            deadline = time.monotonic() + 30
            while app.stats("Unified")["num_running"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            ray.kill(victim)
            for s in streams:
                s.result()  # each ends one way or another: cut off, or an error
        stats = app.wait_for_idle(40)["Unified"]
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_unfinished_requests"] == 0, stats
        # Serve replaces the gateway replica; it serves again.
        wait_until_serving(app.base, 60, "no gateway replica served after the kill")
        assert app.stats("Unified")["num_output_connections"] <= 1  # the dead gateway's connection is gone
    finally:
        serve.delete(name)
