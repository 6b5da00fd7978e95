"""Token outputs from engine replicas to gateways: one TCP stream per (engine replica, gateway)
pair carrying every sequence's new outputs of an engine step as one frame, instead of one Ray
Serve streaming item per token per request (each item a Ray message, a wake-up and a GIL
hand-off on both sides: at concurrency 8 that cost a third of the engine's step time).

The request itself still goes through Ray Serve: the gateway calls the engine replica's
`generate` through the deployment handle (the pool's request router picks the replica; Serve
counts the request as ongoing, queues and rejects it, and cancelling the call aborts it). Only
where the outputs travel changes:

- The call names the gateway (`reply_to`: `OutputChannels.gateway_id`). A replica with no
  connection from that gateway yields the outputs on the call itself (as before), after a
  `ChannelOffer` with its listener's address; the gateway connects in the background.
- Once the gateway is connected, the replica's `OutputSink` for it takes the request's outputs:
  everything sent during one event-loop turn (an engine step's outputs) leaves as one frame,
  `[version, [[request_id, output], ...]]` (msgpack, `encode_output`). The call then yields one
  item, `ChannelDone(conn_id, num_outputs)`, when the request ends. A request never switches
  paths midway, so its outputs stay in order.
- The gateway demultiplexes frames into each request's queue (`Pending`). A request ends at its
  finished output; `ChannelDone` tells how many outputs to expect, so a connection that breaks
  before they arrived fails exactly the requests still waiting on it.
- Failures: a replica that dies fails its calls (Ray Serve's error, per request) and its
  connections. A connection that closes on the replica side (gateway gone or restarted) aborts
  every request still sending on it (`on_close`), so their KV is freed.

Pure asyncio and msgpack, no Ray: `frames` (the wire format and the items a call yields),
`sender` (the engine replica's listener and sinks), `receiver` (the gateway's connections and
waiting requests); the deployments wire them in (decode/deployment.py, gateway/deployment.py). Wire format (version 1), each frame a 4-byte big-endian length then
msgpack: gateway -> replica `{"v": 1, "gateway": id, "conn": n}` once; replica -> gateway
`[1, [[request_id, output], ...]]` per flush. The gateway id is a random 128-bit value that only
travels inside Ray calls: it is what lets a connection receive a gateway's outputs.
"""
