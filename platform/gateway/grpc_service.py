"""The `pdserve.v1.Generation` gRPC API (pdserve.proto) over an `OpenAIService`'s client, with its
API keys, bounds, deadline and tokenizing threads: gRPC takes nothing the HTTP API refuses.

In: a `GenerateRequest` protobuf and, from Ray Serve's gRPC proxy, the call's context (its
metadata; where the status code goes). Out: one `GenerateResponse` with the whole completion
(`generate`), or one per engine output that produced tokens (`generate_stream`), the last with
`finish_reason`. Each RPC is one sequence: no `n`, no logprobs, no chat template.

Errors set a status on the context and are re-raised, so the proxy answers with that code:
bad input INVALID_ARGUMENT, a missing or wrong API key UNAUTHENTICATED, a full or failed pool
UNAVAILABLE, past the deadline DEADLINE_EXCEEDED, anything else INTERNAL naming no internals (the
error goes to the log). The largest message is `gateway.max_body_bytes`, set where Ray starts
(RAY_SERVE_GRPC_MAX_MESSAGE_SIZE: Ray Serve reads it once per process). This module knows no
Ray: the context is anything with `invocation_metadata`, `set_code` and `set_details`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Protocol, Sequence

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DeadlineExceededError, InvalidRequestError, OverloadedError
from pdserve.gateway import pdserve_pb2 as pb
from pdserve.gateway.errors import APIError, UnavailableError, outcome_of
from pdserve.gateway.openai_service import OpenAIService, check_prompt
from pdserve.protocol import GenerateRequest
from pdserve.telemetry.requests import RequestRecord

log = logging.getLogger(__name__)

_DEFAULT_MAX_TOKENS = 16  # as /v1/completions


class CallContext(Protocol):
    """What this module uses of a gRPC servicer context (Ray Serve's `RayServegRPCContext`)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...


def status_code(e: BaseException) -> grpc.StatusCode | None:
    """The one mapping from pdserve's exceptions to gRPC status codes (None: the client left)."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return None
    if isinstance(e, APIError) and e.status == 401:
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, (OverloadedError, UnavailableError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, DeadlineExceededError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def _set_status(context: CallContext | None, e: BaseException, request_id: str) -> None:
    code = status_code(e)
    if context is None or code is None:
        return
    context.set_code(code)
    if code == grpc.StatusCode.INTERNAL:
        log.error("gRPC request %s failed: %r", request_id, e, exc_info=e)
        context.set_details(f"the server failed to complete this request (request id {request_id})")
    else:
        context.set_details(str(e) if code != grpc.StatusCode.UNAVAILABLE else f"{e}; retry shortly")


class GrpcGeneration:
    def __init__(self, service: OpenAIService, metrics=None):
        # metrics: a pdserve.telemetry.metrics.GatewayMetrics, or None (no series recorded).
        self.service, self.client, self.metrics = service, service.client, metrics

    async def generate(self, request_pb: pb.GenerateRequest, context: CallContext | None = None) -> pb.GenerateResponse:
        """The whole completion; `completion_tokens` counts `token_ids`."""
        rec = self._record("Generate", request_pb, context)
        try:
            rid, req = await self._request(request_pb, context, rec)
            text, token_ids, finish_reason = [], [], ""
            async for out in self.client.generate(req):
                rec.output(0, len(out.new_token_ids))
                text.append(out.new_text)
                token_ids += out.new_token_ids
                if out.finished:
                    finish_reason = out.finish_reason or ""
        except BaseException as e:
            rec.finish(outcome_of(e), e)
            _set_status(context, e, request_pb.request_id[:128])
            raise
        rec.finish("ok", None, len(req.prompt_token_ids), len(token_ids))
        return pb.GenerateResponse(request_id=rid, text="".join(text), token_ids=token_ids,
                                   finish_reason=finish_reason, prompt_tokens=len(req.prompt_token_ids),
                                   completion_tokens=len(token_ids))

    async def generate_stream(self, request_pb: pb.GenerateRequest,
                              context: CallContext | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One response per engine output with new tokens (or the finish); their texts and token
        ids concatenate to `generate`'s. Leaving early cancels the request in the pools."""
        rec = self._record("GenerateStream", request_pb, context)
        try:
            rid, req = await self._request(request_pb, context, rec)
            num_tokens = 0
            async for out in self.client.generate(req):
                rec.output(0, len(out.new_token_ids))
                if not out.new_token_ids and not out.finished:
                    continue
                num_tokens += len(out.new_token_ids)
                yield pb.GenerateResponse(request_id=rid, text=out.new_text, token_ids=out.new_token_ids,
                                          finish_reason=(out.finish_reason or "") if out.finished else "",
                                          prompt_tokens=len(req.prompt_token_ids), completion_tokens=num_tokens)
        except BaseException as e:
            rec.finish(outcome_of(e), e)
            _set_status(context, e, request_pb.request_id[:128])
            raise
        rec.finish("ok", None, len(req.prompt_token_ids), num_tokens)

    # -- request -> GenerateRequest ------------------------------------------------------------
    def _record(self, rpc: str, r: pb.GenerateRequest, context: CallContext | None) -> RequestRecord:
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        return RequestRecord(f"/pdserve.v1.Generation/{rpc}", r.request_id[:128], metadata, self.metrics)

    async def _request(self, r: pb.GenerateRequest, context: CallContext | None,
                       rec: RequestRecord) -> tuple[str, GenerateRequest]:
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        salt = self.service.cache_salt(self.service.api_keys.check(metadata.get("authorization", "")), None)
        return await self.service.off_loop(r.ByteSize(), self._build, r, rec, salt)

    def _build(self, r: pb.GenerateRequest, rec: RequestRecord, salt: str | None) -> tuple[str, GenerateRequest]:
        """On a worker thread: bound, tokenize and check the request, as the HTTP routes do."""
        service, bounds = self.service, self.service.bounds
        source = r.WhichOneof("input")
        if source is None:
            raise InvalidRequestError("send prompt or prompt_token_ids", param="prompt")
        # One past the bound is enough to refuse: a million stop strings are never made into a list.
        bounds.check_counts({"stop": list(r.stop[:bounds.max_stops + 1]), "prompt": r.prompt if source == "prompt"
                             else None})
        ids = service.tokenizer.encode(r.prompt) if source == "prompt" else list(r.prompt_token_ids.ids)
        max_tokens = r.max_tokens if r.HasField("max_tokens") else _DEFAULT_MAX_TOKENS
        check_prompt(ids, max_tokens, service.max_model_len, service.tokenizer.vocab_size, source)
        optional = {f: getattr(r, f) for f in ("temperature", "top_p", "seed") if r.HasField(f)}
        params = SamplingParams(max_tokens=max_tokens, top_k=r.top_k, min_p=r.min_p, stop=tuple(r.stop),
                                ignore_eos=r.ignore_eos, cache_salt=salt, **optional)
        rid = r.request_id[:128] or uuid.uuid4().hex
        # Client ids may repeat; engine ids must not.
        return rid, GenerateRequest(f"{rid}-{uuid.uuid4().hex[:8]}", ids, params, rec.trace_context,
                                    rec.start_unix_s + service.config.request_timeout_s)
