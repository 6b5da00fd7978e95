"""In-process decode replicas that die mid-stream, for the gateway's migration tests (no Ray).

`DyingReplicas(servers, die_after)` places each attempt of a sequence on the next live replica
(round robin) and streams it from that replica's `DecodeServer`. Replica i dies once one of its
streams has delivered `die_after[i]` tokens (None: never), or would deliver more than that with
its next output (an engine hands a slow reader several tokens at once): that stream, and every
other stream still open on it, fails at its next output with `UnavailableError`, as the gateway's
client of the pools reports a replica that died or whose output connection dropped; a dead
replica gets no more placements. `delivered[k]`: the tokens attempt k delivered.

`MigratingClient` is the gateway's `GenerateClient` over them: each sequence through
`pdserve.gateway.migration.migrating`, as `PoolsClient` does over Ray.
"""

from __future__ import annotations

from contextlib import aclosing

from pdserve.gateway.errors import UnavailableError
from pdserve.gateway.migration import migrating


class DyingReplicas:
    def __init__(self, servers, die_after: list[int | None]):
        self.servers, self.die_after = servers, die_after
        self.is_alive = [True] * len(servers)
        self.placements = []  # (replica index, GenerateRequest) per attempt
        self.delivered = []  # tokens each attempt delivered
        self._turn = 0

    def _place(self) -> int:
        live = [i for i, alive in enumerate(self.is_alive) if alive]
        if not live:
            raise UnavailableError("no decode replica is alive")
        self._turn += 1
        return live[(self._turn - 1) % len(live)]

    async def attempt(self, req):
        i = self._place()
        self.placements.append((i, req))
        n, limit = len(self.delivered), self.die_after[i]
        self.delivered.append(0)
        async with aclosing(self.servers[i].generate(req)) as outs:
            async for out in outs:
                # An output that would take the stream past the limit is lost with the replica (a
                # first one only when it would also finish the stream: the replica died first).
                num_tokens = self.delivered[n]
                if limit is not None and num_tokens + len(out.new_token_ids) > limit and (num_tokens or out.finished):
                    self.is_alive[i] = False
                if not self.is_alive[i]:
                    raise UnavailableError(f"decode replica {i} died")
                yield out
                self.delivered[n] += len(out.new_token_ids)
                if limit is not None and self.delivered[n] >= limit:
                    self.is_alive[i] = False
                    raise UnavailableError(f"decode replica {i} died")


class MigratingClient:
    def __init__(self, replicas: DyingReplicas, migration_limit: int = 3):
        self.replicas, self.migration_limit = replicas, migration_limit
        self.num_migrations = 0

    def generate(self, req):
        return migrating(self.replicas.attempt, req, self.migration_limit, self._migrated)

    def _migrated(self) -> None:
        self.num_migrations += 1

    async def health(self):
        return {"decode": any(self.replicas.is_alive)}
