"""Which leases are live, in shared memory, for the importers on the exporter's host.

A local read (the importer copies the blocks straight out of the exporter's mapped cache) still
asked the exporter, over the backend, whether the lease was live: a READ and its answer, ~0.2 ms
between two Python processes, against ~0.1 ms for the copy of a 128 MiB pull on a GPU. The board
answers that question in memory instead. The exporter owns it: a sealed memfd (shared_memory.py)
that only the exporter can write and importers on its host map read-only, one slot per lease:

    [generation, token digest (16 bytes)]   int64 x 3

Publishing a lease writes the digest of its token, then an odd generation that slot never held;
ending it (ack, expiry) makes the generation even again before its blocks go back to the pool
(the exporter's lock orders that write before any later one). An importer holding the handle
(slot, generation, token) reads the slot before its copy and again once the copy has completed:
the same odd generation both times, and its token's digest, mean the lease was live for the whole
copy, so the blocks were pinned and the bytes are the prefill's. Anything else (another
generation, a full board, a board it cannot map, an exporter process that no longer holds it) and
it asks over the backend as before, which also says why.

What a reader of the board learns: which slots are live, and digests from which no token can be
recovered (a token releases a lease; the board cannot). It sits beside the cache, which the same
readers can map already.
"""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np

from pdserve.engine.shared_memory import SharedRegion, locate, map_region, shared_zeros

SLOTS = 4096  # leases on the board at once; past that, new leases are read over the backend


def token_digest(token: str) -> tuple[int, int]:
    """A lease token's 16-byte digest, as the board's two int64 words."""
    raw = hashlib.blake2b(token.encode(), digest_size=16).digest()
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


class LeaseBoard:
    """The exporter's side: publishes and ends leases (thread-safe)."""

    def __init__(self, slots: int = SLOTS):
        import torch

        self._table = shared_zeros((slots, 3), torch.int64)
        self.region: SharedRegion | None = locate(self._table)  # None: no shared memory here (no board)
        self._words = self._table.numpy()
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def publish(self, token: str) -> tuple[int, int] | None:
        """A slot for a new lease: (slot, generation), or None when the board is full."""
        with self._lock:
            if self.region is None or not self._free:
                return None
            slot = self._free.pop()
            self._words[slot, 1:3] = token_digest(token)
            generation = int(self._words[slot, 0]) + 1  # odd: live; never held by this slot before
            self._words[slot, 0] = generation
            return slot, generation

    def end(self, slot: int, generation: int) -> None:
        """The lease published as (slot, generation) ended: call before its blocks are unpinned."""
        with self._lock:
            if self._words[slot, 0] == generation:
                self._words[slot, 0] = generation + 1
                self._free.append(slot)

    @property
    def num_live(self) -> int:
        return int(np.count_nonzero(self._words[:, 0] & 1))


class BoardView:
    """An importer's read-only view of an exporter's board."""

    def __init__(self, region: SharedRegion):
        self.region = region
        self._mapping = map_region(region)
        self.words = None if self._mapping is None else np.frombuffer(self._mapping, dtype=np.int64).reshape(-1, 3)

    def exporter_alive(self) -> bool:
        """The exporter's process still holds the board (a killed one ends no lease: its board, kept
        mapped here, would vouch for leases forever). One stat, a few microseconds."""
        try:
            st = os.stat(f"/proc/{self.region.pid}/fd/{self.region.fd}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.region.file_id

    def is_live(self, slot: int, generation: int, digest: tuple[int, int]) -> bool:
        words = self.words
        if words is None or not 0 <= slot < len(words) or generation % 2 == 0:
            return False
        row = words[slot].copy()  # one read of the three words; the generation decides
        return int(row[0]) == generation and (int(row[1]), int(row[2])) == digest
