"""A request prefilled the way a prefill replica does it, without Ray: for engine tests of the
hand-over to a decode engine."""

from __future__ import annotations

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput


def prefill_first(engine: LLMEngine, request_id: str, prompt: list[int], params, **options) -> RequestOutput:
    """Add `request_id` as a prefill-only request (`options` as `add_request`'s) and step `engine`
    until its first output, which holds its KV blocks (`kv_block_ids`) until `release_kv`."""
    engine.add_request(request_id, prompt, params, prefill_only=True, **options)
    first = None
    while first is None:
        first = next((out for out in engine.step() if out.request_id == request_id), None)
    return first
