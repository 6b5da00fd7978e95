"""The prefix-aware routers of this process, by pool: what the rest of the process reads of a pool
through them. A decode replica's placement reads the prefill pool's queue from its router for that
pool (`least_queued_tokens`).

Its own module, read by attribute: Ray Serve ships a router class to the processes that call its
pool by value, so a registry among the router module's own globals would be a copy per class.
"""

from __future__ import annotations

from typing import Protocol


class PoolView(Protocol):
    def least_queued_tokens(self) -> float | None: ...


routers: dict[str, PoolView] = {}


def least_queued_tokens(pool: str = "prefill") -> float | None:
    """The prompt tokens queued on `pool`'s least-queued replica as this process's router for it
    sees them now (None: no router yet, it is made at the first call, or no replica)."""
    router = routers.get(pool)
    return None if router is None else router.least_queued_tokens()
