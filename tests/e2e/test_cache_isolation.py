"""The cross-tenant prefix oracle, closed: with API keys (cache_isolation per_key by default), a
tenant's guess of another tenant's prompt gets the same cached_tokens, 0, right or wrong, and
the two never share blocks; without keys (shared), a repeated prompt is served from the cache
as before."""

from __future__ import annotations

import openai

from .conftest import OTHER_KEY

SECRET = "The launch code for the northern silo is seven four one one nine and the backup is " * 3
# A wrong guess shares no block with the secret (nor with the right guess, asked first).
WRONG = "Every launch of the southern silo needs codes two two eight three five, and its backup " * 3


def _cached(client, model: str, prompt: str) -> int:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_learns_nothing_of_anothers_prompt(serve_apps):
    app = serve_apps["colo"]
    other = openai.OpenAI(base_url=app.client.base_url, api_key=OTHER_KEY, max_retries=0, timeout=120)
    _cached(app.client, app.model, SECRET)  # tenant A's prompt is in the cache now
    assert _cached(app.client, app.model, SECRET) > 0  # A's own repeat is served from it
    right, wrong = _cached(other, app.model, SECRET), _cached(other, app.model, WRONG)
    assert right == wrong == 0
    stats = app.wait_for_idle()
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] for s in stats.values())


def test_without_keys_requests_share_the_cache_as_before(serve_apps):
    app = serve_apps["disagg"]
    _cached(app.client, app.model, SECRET)
    assert _cached(app.client, app.model, SECRET) > _cached(app.client, app.model, WRONG + " x")
