"""What crosses the wire between a KV exporter (prefill) and importer (decode), and the checks
made before any KV byte moves.

- `KVLayout`: the cache shape one side holds (model, layers, block size, KV heads on this rank,
  head dim, dtype, TP size and rank, and whether it is the latent layout). `check_compatible` raises
  `LayoutMismatchError` when two sides cannot exchange blocks, and `head_slice` says which of the
  exporter's heads a decode rank pulls when decode runs k times prefill's TP degree. A latent cache
  (multi-head latent attention: one vector a token a layer, kv_cache.py) has one plane instead of K
  and V and no heads to slice: every rank holds the whole latent, every decode rank pulls it whole
  from one prefill rank, and any two TP degrees pair.
- `KVHandle`: what prefill returns with the first token; small and plain (dict/msgpack). With a
  `cache_region` (the exporter's cache is in shared memory, or on a GPU shared over CUDA IPC), an
  importer on the same host (and GPU) that can map that region asks for a *local* read: the exporter answers DATA with `local` and no chunks,
  holds the blocks while the importer copies them out of its cache, and releases them on ACK/DONE.
- Control frames: one message each, a 16-byte header `magic, version, kind, payload length`
  (struct) followed by a msgpack map, at most `CONTROL_FRAME_BYTES` in all (a receiver posts one
  buffer of that size, so a frame costs one message, not two). Nothing from the network is unpickled.
- Block data (version 2): after its DATA frame, the exporter sends the blocks as `chunk_bounds`
  says, one raw message per chunk. The transfer tensor `[layers, planes, n, block_size, heads, head_dim]`
  (planes: K and V, or the one latent) is read as `layers * planes` slabs (K/V: slab s is layer
  s // 2, K if s is even, V if odd; latent: slab s is layer s); a chunk is a run
  of consecutive slabs, one slab each unless slabs are smaller than `MIN_CHUNK_BYTES`. Both sides
  derive the same chunks from the shape, so the importer posts every receive before the first byte
  arrives and each side copies (or sends/receives in place) chunk by chunk while the rest is on the
  wire.
Pure: no sockets, no torch.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass

import msgpack

from pdserve.errors import PdserveError, ReplicaError
from pdserve.engine.cuda_ipc import CudaRegion
from pdserve.engine.shared_memory import SharedRegion

MAGIC = b"PDKV"
VERSION = 2  # 2: one message per control frame; block data in chunks (`chunk_bounds`)
HEADER = struct.Struct("<4sHHQ")  # magic, version, kind, payload length
HEADER_SIZE = HEADER.size  # 16
CONTROL_FRAME_BYTES = 64 << 10  # control frames are small; a larger one is corrupt
MAX_PAYLOAD_BYTES = CONTROL_FRAME_BYTES - HEADER_SIZE
MIN_CHUNK_BYTES = 256 << 10  # smaller slabs go together: per-message costs would dominate

# Frame kinds.
READ, DATA, ACK, ERROR, DONE = 1, 2, 3, 4, 5  # DONE: read complete, keep the lease


class KVTransferError(PdserveError):
    """Base of transfer errors. `retryable`: the request may succeed on another attempt/replica
    (those are `ReplicaError`s too)."""
    retryable = False


class ExporterUnreachableError(KVTransferError, ReplicaError):
    """The exporter did not answer in time or went away mid-transfer."""
    retryable = True


class LeaseExpiredError(KVTransferError, ReplicaError):
    """The exporter no longer holds the blocks (lease expired or already released)."""
    retryable = True


class UnknownRequestError(KVTransferError):
    """The exporter has no blocks for this request id."""


class ProtocolError(KVTransferError):
    """A frame that is short, corrupt, or of another protocol version."""


class LayoutMismatchError(KVTransferError):
    """Exporter and importer caches cannot exchange blocks (model, dtype, block size, heads)."""


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's KV heads, all ranks together
    head_dim: int
    dtype: str  # e.g. "float32"
    tp_size: int = 1
    tp_rank: int = 0
    # The latent layout: one plane, one "head" `head_dim` wide (the latent), whole on every rank.
    is_latent: bool = False

    @property
    def num_planes(self) -> int:
        return 1 if self.is_latent else 2

    @property
    def local_heads(self) -> tuple[int, int]:
        """The [start, end) global KV heads this rank holds (one replicated head when heads < ranks;
        a latent cache's one, whole, on every rank)."""
        if self.is_latent:
            return 0, self.num_kv_heads
        if self.num_kv_heads >= self.tp_size:
            per = self.num_kv_heads // self.tp_size
            return self.tp_rank * per, (self.tp_rank + 1) * per
        h = self.tp_rank * self.num_kv_heads // self.tp_size
        return h, h + 1


@dataclass(frozen=True)
class KVHandle:
    exporter_id: str
    address: str  # "host:port"
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    layout: KVLayout
    lease_token: str  # the lease's capability: READ, ACK and DONE must carry it (never sent but in Ray calls)
    # The exporter's cache, when other processes on its host may map it: shared memory (CPU) or CUDA IPC.
    cache_region: SharedRegion | CudaRegion | None = None
    # Where this lease is published for importers on that host (lease_board.py): the board, the
    # lease's slot and generation. None/-1: ask the exporter over the backend.
    lease_board: SharedRegion | None = None
    lease_slot: int = -1
    lease_generation: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_ids"] = list(self.block_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVHandle":
        try:
            region = d.get("cache_region")
            if region is not None:
                region = (CudaRegion if "device_uuid" in region else SharedRegion).from_dict(region)
            board = d.get("lease_board")
            return cls(**{**d, "block_ids": tuple(map(int, d["block_ids"])), "layout": KVLayout(**d["layout"]),
                          "cache_region": region, "lease_board": None if board is None else SharedRegion.from_dict(board),
                          "lease_slot": int(d.get("lease_slot", -1)), "lease_generation": int(d.get("lease_generation", 0))})
        except (TypeError, KeyError, ValueError) as e:
            raise ProtocolError(f"malformed KV handle: {e}") from e


def check_compatible(exporter: KVLayout, importer: KVLayout) -> None:
    problems = [f"{name}: exporter {getattr(exporter, name)!r}, importer {getattr(importer, name)!r}"
                for name in ("model_id", "is_latent", "num_layers", "block_size", "num_kv_heads", "head_dim",
                             "dtype")
                if getattr(exporter, name) != getattr(importer, name)]
    if problems:
        raise LayoutMismatchError("KV caches are incompatible: " + "; ".join(problems))
    if importer.is_latent:  # every prefill rank holds the whole latent: any two degrees pair
        return
    if importer.tp_size < exporter.tp_size or importer.tp_size % exporter.tp_size:
        raise LayoutMismatchError(
            f"decode tensor-parallel degree {importer.tp_size} must be a multiple of prefill's {exporter.tp_size} "
            f"(decode TP >= prefill TP): each decode rank pulls its heads from one prefill rank")


def source_rank(exporter_tp_size: int, importer: KVLayout) -> int:
    """The prefill rank holding the heads this decode rank needs (a latent cache: any rank holds
    it whole, so the decode ranks spread over the prefill ranks, whichever degree is larger)."""
    if importer.is_latent:
        return importer.tp_rank % exporter_tp_size
    return importer.tp_rank // (importer.tp_size // exporter_tp_size)


def head_slice(exporter: KVLayout, importer: KVLayout) -> tuple[int, int]:
    """The [start, end) range of the exporter rank's *local* heads that this importer rank needs."""
    check_compatible(exporter, importer)
    if source_rank(exporter.tp_size, importer) != exporter.tp_rank:
        raise LayoutMismatchError(f"decode rank {importer.tp_rank} pulls from prefill rank "
                                  f"{source_rank(exporter.tp_size, importer)}, not {exporter.tp_rank}")
    (es, ee), (is_, ie) = exporter.local_heads, importer.local_heads
    assert es <= is_ and ie <= ee, "an importer rank's heads lie inside its source rank's"
    return is_ - es, ie - es


# What an ERROR frame's `code` says, both ways.
ERROR_CODES = {"unknown": UnknownRequestError, "expired": LeaseExpiredError, "layout": LayoutMismatchError,
               "protocol": ProtocolError}


def lease_ref(frame: dict) -> tuple[str, str]:
    """A READ, ACK or DONE frame's (request id, lease token): strings, "" where absent (no lease
    has those), ProtocolError for anything else."""
    rid, token = frame.get("request_id", ""), frame.get("lease_token", "")
    if not isinstance(rid, str) or not isinstance(token, str):
        raise ProtocolError("a frame's request_id and lease_token must be strings")
    return rid, token


def error_frame(e: KVTransferError) -> dict:
    return {"code": next((c for c, cls in ERROR_CODES.items() if type(e) is cls), "protocol"), "message": str(e)}


def error_of(reply: dict) -> KVTransferError:
    """The exporter's ERROR frame as the error it raised there."""
    return ERROR_CODES.get(reply.get("code"), ProtocolError)(str(reply.get("message", "exporter error")))


def encode_frame(kind: int, payload: dict) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, kind, len(body)) + body


def decode_header(header: bytes) -> tuple[int, int]:
    """-> (kind, payload length); ProtocolError for anything that is not our frame."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"short frame header: {len(header)} of {HEADER_SIZE} bytes")
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"not a pdserve KV frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"KV transfer protocol version {version}, this side speaks {VERSION}: "
                            "run the same pdserve version on both pools")
    if kind not in (READ, DATA, ACK, ERROR, DONE) or length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"bad frame kind {kind} or payload length {length}")
    return kind, length


def decode_frame(frame: bytes) -> tuple[int, dict]:
    """One control frame (header and payload, possibly followed by unused buffer) -> (kind, payload)."""
    kind, length = decode_header(frame[:HEADER_SIZE])
    if len(frame) < HEADER_SIZE + length:
        raise ProtocolError(f"short frame: {len(frame) - HEADER_SIZE} of {length} payload bytes")
    return kind, decode_payload(frame[HEADER_SIZE:HEADER_SIZE + length])


def chunk_bounds(num_slabs: int, slab_bytes: int) -> list[tuple[int, int]]:
    """The [start, end) slab ranges the block data travels in, one message each (see above)."""
    per = max(1, -(-MIN_CHUNK_BYTES // max(slab_bytes, 1)))
    return [(s, min(s + per, num_slabs)) for s in range(0, num_slabs, per)]


def decode_payload(body: bytes) -> dict:
    try:
        payload = msgpack.unpackb(body, raw=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ProtocolError(f"corrupt frame payload: {e}") from e
    if not isinstance(payload, dict):
        raise ProtocolError("corrupt frame payload: not a map")
    return payload
