"""Mid-stream migration: a sequence whose decode replica fails after it streamed tokens goes on,
on another replica, as one uninterrupted stream.

`migrating(attempt, req, limit)` yields what `attempt(req)` (one call to the decode pool, with
its own retry of failures before the first token) yields. When that stream fails with a
`ReplicaError` (the replica died, its output connection dropped, its engine died; the caller
maps its transport's errors onto those) after tokens arrived, it submits the sequence again,
resumed: the prompt and every output token received so far (`GenerateRequest.output_token_ids`),
under a new engine request id, through the same placement as any request. The engine there
counts those tokens as outputs (`max_tokens`, penalties, the seeded sampler's position, usage)
and replays them through its detokenizer and stop-string window, so the next text delta is the
one the failed replica would have sent: the client sees one stream, one finish, no text repeated
or missing, and greedy or seeded outputs identical to an uninterrupted run. Up to `limit`
migrations per sequence (0: none); past it, or for a failure before any token, the error is
raised as before. A `RequestError` (bad input, a deadline) is never migrated.

Each choice of an `n > 1` request is its own sequence, so each migrates on its own. Outputs of a
resumed attempt are passed on with the original engine request id and the first attempt's
`num_cached_tokens` (usage reports the prompt's cache hits where it was first placed). A grammar
(structured output) would be rebuilt on the new replica by replaying the same tokens, never by
generating them again.

No Ray here: the caller (`PoolsClient`) makes the calls and maps Ray's exceptions.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from pdserve.engine.outputs import RequestOutput
from pdserve.errors import ReplicaError
from pdserve.protocol import GenerateRequest

log = logging.getLogger(__name__)

Attempt = Callable[[GenerateRequest], AsyncIterator[RequestOutput]]


def resumed(req: GenerateRequest, output_token_ids: list[int], migration: int) -> GenerateRequest:
    """`req` to be continued after `output_token_ids`, as its `migration`-th migration. Its prompt
    logprobs went out with its first output already: the resumed request asks for none (and so
    may reuse the prefix cache)."""
    params = req.params
    if params.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(req, request_id=f"{req.request_id}-m{migration}", params=params,
                               output_token_ids=[*req.output_token_ids, *output_token_ids])


async def migrating(attempt: Attempt, req: GenerateRequest, limit: int,
                    on_migration: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
    """`attempt(req)`'s outputs, continued on another replica after a replica failure (see the
    module docstring); `on_migration()` is called for each migration (a metric)."""
    received: list[int] = []
    num_cached_tokens = 0
    current, migrations = req, 0
    while True:
        try:
            async with aclosing(attempt(current)) as outs:
                async for out in outs:
                    if migrations:
                        out.request_id, out.num_cached_tokens = req.request_id, num_cached_tokens
                    else:
                        num_cached_tokens = out.num_cached_tokens
                    received += out.new_token_ids
                    yield out
                    if out.finished:
                        return
            return
        except ReplicaError as e:
            if not received or migrations >= limit:
                raise
            migrations += 1
            log.info("request %s: its decode replica failed after %d tokens (%r); migrating it to another "
                     "replica (migration %d of at most %d)", req.request_id, len(received), e, migrations, limit)
            if on_migration is not None:
                on_migration()
            current = resumed(req, received, migrations)
