"""Where requests run: the prefix-aware router (DESIGN.md sections 2 and 3).

Pure logic, importable without Ray or Redis:
- `block_hashes(token_ids, block_size)`: chained hashes of full blocks (the engine's naming,
  `pdserve.engine.block_hash`).
- `RadixIndex`: which replica holds which blocks (`insert`, `remove`, `remove_replica`, `match`).
- `pdserve.router.policy`: how a replica is chosen from the index and the replicas' load.
- `pdserve.router.kv_events`: the KV-event stream that keeps routers' indexes true (Redis).
The Ray Serve glue (`PrefixAwareRouter`, `KVHeadroomRouter`) lives in `pdserve.router.request_router`.
"""

from pdserve.engine.block_hash import ROOT_BLOCK_HASH, block_hashes
from pdserve.router.radix_index import RadixIndex

__all__ = ["ROOT_BLOCK_HASH", "RadixIndex", "block_hashes"]
