"""A hostile client against the running disaggregated app: no request, however malformed or
large, costs another client anything.

Each request of the corpus (tests/fakes/hostile_requests.py) gets its 4xx within 10 s; after
each, /health is 200 and no replica was restarted; a greedy request gives the same text after
the corpus as before. A stream running beside the heaviest requests the gateway takes (a 4 MiB
prompt, 16,000 prompts, the most stop strings allowed) completes unchanged.
"""

from __future__ import annotations

import json
import threading
import time

import requests

from tests.fakes.hostile_requests import hostile_requests

GREEDY = {"prompt": "The lighthouse keeper walked along the shore and", "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}


def _replica_pids(app) -> dict[str, int]:
    return {pool: app.stats(pool)["pid"] for pool in app.pools}


def _greedy_text(app) -> str:
    return app.client.completions.create(model=app.model, **GREEDY).choices[0].text


def test_no_hostile_request_costs_anyone_anything(serve_apps):
    app = serve_apps["disagg"]
    before, pids = _greedy_text(app), _replica_pids(app)
    corpus = hostile_requests(app.model)
    assert len(corpus) >= 40
    for name, path, body, status, param in corpus:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        t0 = time.monotonic()
        r = app.post(path, data=data, headers={"Content-Type": "application/json"})
        assert time.monotonic() - t0 < 10, name
        assert r.status_code == status, (name, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param, (name, err)
        assert requests.get(f"{app.base}/health", timeout=10).status_code == 200, name
        assert _replica_pids(app) == pids, f"a replica restarted after: {name}"
    assert _greedy_text(app) == before
    stats = app.wait_for_idle()
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] for s in stats.values()), stats


def test_a_stream_beside_the_heaviest_requests_completes_unchanged(serve_apps):
    app = serve_apps["disagg"]
    stream_body = {"model": app.model, **GREEDY, "max_tokens": 64}
    reference = app.client.completions.create(**stream_body).choices[0].text
    heavy = [  # (body, status): each as large as the gateway takes
        ({"model": app.model, "prompt": "x" * ((4 << 20) - 200), "max_tokens": 2}, 400),
        ({"model": app.model, "prompt": [[5]] * 16_000, "max_tokens": 2}, 400),
        ({"model": app.model, "prompt": "hello", "max_tokens": 8, "stop": ["\u00e9" * 512] * 16}, 200),
    ]
    answers = []

    def send_heavy():
        for body, _ in heavy:
            answers.append(app.post("/v1/completions", data=json.dumps(body).encode(),
                                    headers={"Content-Type": "application/json"}).status_code)

    text, sender = [], threading.Thread(target=send_heavy)
    for i, chunk in enumerate(app.client.completions.create(**stream_body, stream=True)):
        if i == 2:
            sender.start()
        text.append(chunk.choices[0].text if chunk.choices else "")
    sender.join(60)
    assert "".join(text) == reference
    assert answers == [status for _, status in heavy]
