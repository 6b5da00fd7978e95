"""The output connection's wire format and the items an engine replica's call yields about it
(see `pdserve.output`): length-prefixed msgpack frames, `encode_output` / `decode_output` for a
`RequestOutput`, `ChannelOffer`, `ChannelDone`. Pure: no sockets beyond reading one frame.

Every read is bounded before anything is unpacked: the length prefix is checked against the
reader's limit (a hello may be at most `HELLO_MAX_BYTES`, an output frame `MAX_FRAME_BYTES`)
and msgpack unpacks with limits no larger than the frame itself. A frame holds whole entries:
`[request_id, output]`, or `[request_id, {"error": message}]` for a request whose output could not
travel (larger than a frame): that request alone fails.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

import msgpack

from pdserve.engine.outputs import RequestOutput, TokenLogprob

VERSION = 2  # 2: the hello carries the replica's secret; error entries
_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
# The hello, {"v", "gateway", "conn", "secret"}, is about 100 bytes; anything larger is refused unread.
HELLO_MAX_BYTES = 512


class OutputChannelError(Exception):
    """The connection that carried a request's outputs broke before they all arrived."""


@dataclass(frozen=True)
class ChannelOffer:
    """First item of a call whose gateway has no connection to this replica yet: where to connect,
    and the replica's secret for the hello (it travels only inside Ray calls)."""
    host: str
    port: int
    secret: str


@dataclass(frozen=True)
class ChannelDone:
    """Last (and only) item of a call whose outputs went over connection `conn_id`: how many."""
    conn_id: int
    num_outputs: int


def _logprob(lp: TokenLogprob) -> list:
    return [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]]


def _from_logprob(x: list) -> TokenLogprob:
    return TokenLogprob(x[0], x[1], x[2], tuple((t, v) for t, v in x[3]))


def encode_output(out: RequestOutput) -> list:
    """A decode-side output as plain msgpack types (no KV ids or RNG state: those stay in prefill)."""
    assert out.kv_block_ids is None, "prefill-only fields on the output channel"
    prompt = None if out.prompt_logprobs is None else [None if lp is None else _logprob(lp)
                                                       for lp in out.prompt_logprobs]
    return [out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.stop_reason,
            [_logprob(lp) for lp in out.new_logprobs], prompt, out.num_prompt_tokens, out.num_output_tokens,
            out.num_cached_tokens]


def decode_output(request_id: str, x: list) -> RequestOutput:
    prompt = None if x[6] is None else [None if lp is None else _from_logprob(lp) for lp in x[6]]
    return RequestOutput(request_id, x[0], x[1], x[2], x[3], x[4], [_from_logprob(lp) for lp in x[5]], prompt,
                         x[7], x[8], x[9])


def frame(payload) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def pack_entry(request_id: str, out: RequestOutput) -> bytes:
    """One output as a frame entry, packed: a frame is `entries_frame` of such entries."""
    return msgpack.packb([request_id, encode_output(out)], use_bin_type=True)


def pack_error_entry(request_id: str, message: str) -> bytes:
    return msgpack.packb([request_id, {"error": message}], use_bin_type=True)


def entries_frame(entries: list[bytes]) -> bytes:
    """`[VERSION, [entry, ...]]` from packed entries, without unpacking them again."""
    packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack_array_header(2) + packer.pack(VERSION) + packer.pack_array_header(len(entries)) + b"".join(entries)
    return _LEN.pack(len(body)) + body


# A frame's header (length prefix, the two arrays' headers, the version) is under this.
FRAME_OVERHEAD_BYTES = 16


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES):
    """One frame, refused unread when its length prefix says more than `max_bytes`; unpacked with
    msgpack's limits at the frame's own size (no string, array or map longer than the frame)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > max_bytes:
        raise OutputChannelError(f"frame of {n} bytes over the {max_bytes}-byte limit")
    data = await reader.readexactly(n)
    try:
        return msgpack.unpackb(data, raw=False, max_str_len=n, max_bin_len=n,
                               max_array_len=n, max_map_len=n, max_ext_len=0, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise OutputChannelError(f"a malformed frame ({e})") from None
