"""What the gateway, prefill and decode pools send each other (DESIGN section 2).

Gateway -> decode (or unified): `GenerateRequest`, one per sequence (or the rest of one, resumed
on another replica after its own failed mid-stream). Decode -> prefill: the same request;
prefill -> decode: `PrefillResult` (first token and the KV's `KVHandle`). Engine replica ->
gateway: the engine's own `RequestOutput`s (on the output connection, `pdserve.output`, or on the
call itself).

Plain dataclasses that Ray carries between the replicas of one release; no Ray or HTTP here, and
nothing heavier than the engine's output and sampling types (importing this loads no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.protocol import KVHandle


@dataclass
class GenerateRequest:
    """One sequence to generate: the gateway turns an OpenAI request into n of these."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # W3C trace headers (traceparent, tracestate) of the request's span at the gateway: spans in
    # other processes join its trace (pdserve.telemetry.tracing). Empty when tracing is off.
    trace_context: dict[str, str] = field(default_factory=dict)
    # When the request must be over, in `time.time()` seconds (the gateway's request_timeout_s
    # from its arrival); None: no deadline. Every hop aborts it past this and frees what it holds.
    deadline_s: float | None = None
    # A resumed sequence (mid-stream migration): the outputs another decode replica generated and
    # the client received before that replica failed. The engine continues after them, counting
    # them as outputs (`LLMEngine.add_request`); the decode replica prefills them with the prompt.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class PrefillResult:
    """A prefill replica's answer: the first token and, unless that ended the request, the KV."""
    first: RequestOutput
    kv: KVHandle | None = None  # rank 0's lease (the whole KV when the prefill replica has one rank)
    rank_kv: tuple[KVHandle, ...] = ()  # ranks 1..N-1 of a tensor-parallel prefill replica
    # Prompt tokens a second the prefill replica computes (a moving average of its steps; None
    # before its first): the decode replica's placement predicts remote prefills with it.
    prefill_tokens_per_s: float | None = None

    @property
    def kv_by_rank(self) -> list[KVHandle]:
        return [self.kv, *self.rank_kv] if self.kv is not None else []
