"""The output connection's wire format and the items an engine replica's call yields about it
(see `pdserve.output`): length-prefixed msgpack frames, `encode_output` / `decode_output` for a
`RequestOutput`, `ChannelOffer`, `ChannelDone`. Pure: no sockets beyond reading one frame.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

import msgpack

from pdserve.engine.outputs import RequestOutput, TokenLogprob

VERSION = 1
_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20


class OutputChannelError(Exception):
    """The connection that carried a request's outputs broke before they all arrived."""


@dataclass(frozen=True)
class ChannelOffer:
    """First item of a call whose gateway has no connection to this replica yet: where to connect."""
    host: str
    port: int


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
    assert out.kv_block_ids is None and out.generator_state is None, "prefill-only fields on the output channel"
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


async def read_frame(reader: asyncio.StreamReader):
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME_BYTES:
        raise OutputChannelError(f"frame of {n} bytes over the {MAX_FRAME_BYTES}-byte limit")
    return msgpack.unpackb(await reader.readexactly(n), raw=False)
