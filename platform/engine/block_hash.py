"""Chained block hashes: the one naming of KV blocks the engine's prefix cache, the KV events and
the router share (DESIGN.md section 4).

Block i's hash is `xxh3_64(tokens of block i, seed=hash of block i-1)`, so it names the whole prefix
up to and including block i. The first block's parent is `root_hash(cache_salt)`: requests of
different salts (tenants) never name a block alike, so they never share one, and cache hits
tell nothing across salts. Tokens are hashed as explicit little-endian uint32 bytes: the result is
the same in every process, on every host and under every Python hash seed (no `hash()`).
"""

from __future__ import annotations

import array
import sys
from typing import Sequence

import xxhash

# Parent of the first block. Any fixed 64-bit value works; it must be the same in every process.
ROOT_BLOCK_HASH = 0

_xxh3 = xxhash.xxh3_64_intdigest
if array.array("I").itemsize != 4:  # pragma: no cover - no mainstream platform
    raise ImportError("block_hashes needs a 4-byte C unsigned int")


def root_hash(cache_salt: str | None) -> int:
    """The parent of a request's first block: ROOT_BLOCK_HASH unsalted, else one derived from the salt."""
    return ROOT_BLOCK_HASH if not cache_salt else _xxh3(cache_salt.encode("utf-8", "surrogatepass"), ROOT_BLOCK_HASH)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_BLOCK_HASH) -> list[int]:
    """Chained 64-bit hashes of the *full* blocks of `token_ids` (a partial tail is ignored).

    Pass `parent` (the hash of the block before `token_ids[0]`) to continue a chain.
    """
    step = block_size * 4
    end = len(token_ids) // block_size * block_size
    if end == 0:
        return []
    try:
        data = array.array("I", token_ids[:end] if end < len(token_ids) else token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    if sys.byteorder == "big":
        data.byteswap()
    raw = data.tobytes()
    h = parent
    # One C call per block; the comprehension keeps the loop out of the interpreter's slow path.
    return [h := _xxh3(raw[i:i + step], h) for i in range(0, end * 4, step)]


def group_block_hash(h: int, group: int) -> int:
    """Block hash `h` as layer group `group` names its block (kv_groups.py): group 0 uses `h` itself;
    the others derive their own, so one prefix's blocks in different groups never share a name."""
    return _xxh3(h.to_bytes(8, "little"), group)
