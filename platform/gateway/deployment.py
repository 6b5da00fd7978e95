"""The `Gateway` Ray Serve ingress: FastAPI routes onto `OpenAIService`, and the client that
reaches the pools through deployment handles (Ray's exceptions become pdserve's here)."""

import asyncio
import dataclasses
import logging
import os
import time
from typing import AsyncIterator, Callable

import ray
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from pdserve.config import GatewayConfig, ServeConfig
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import DeadlineExceededError, OverloadedError, ReplicaError
from pdserve.gateway.errors import APIError, UnavailableError, error_response
from pdserve.gateway.grpc_service import GrpcGeneration
from pdserve.gateway.migration import migrating
from pdserve.gateway.openai_service import OpenAIService
from pdserve.output.frames import ChannelDone, ChannelOffer, OutputChannelError
from pdserve.output.receiver import END, OutputChannels, Pending
from pdserve.protocol import GenerateRequest
from pdserve.telemetry.metrics import GatewayMetrics
from pdserve.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)
# FastAPI's own /docs, /redoc and /openapi.json are off: the Gateway serves them itself, and only
# with gateway.enable_docs (the app is frozen when the deployment is defined, before any config).
api = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve deployment", docs_url=None,
              redoc_url=None, openapi_url=None)


class PoolsClient:
    """Sends each sequence to the decode (or unified) pool and streams its outputs back: from the
    replica's output connection to this process when there is one (pdserve.output: one
    frame per engine step for all of this gateway's sequences there), else from the call itself.
    The call goes through the pool's handle either way (its router picks the replica), and stays
    open until the sequence ends; cancelling it aborts the sequence on the replica."""

    def __init__(self, decode: DeploymentHandle, pools: dict[str, DeploymentHandle], migration_limit: int = 3,
                 on_migration: Callable[[], None] | None = None):
        # migration_limit: see GatewayConfig; on_migration(): told of each migration (a metric).
        # The method's handle, made once: `handle.generate` builds a new handle (its options
        # copied) on every attribute access.
        self._generate = decode.options(stream=True).generate
        self.pools = pools
        self.migration_limit, self.on_migration = migration_limit, on_migration
        self.channels = OutputChannels()
        self._tails: set[asyncio.Task] = set()  # calls whose outputs are all in, until their end arrives

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The sequence's outputs. A replica that fails after it streamed tokens (it died, its
        output connection dropped, a `ReplicaError`) hands the sequence on to another, resumed
        after the tokens received (pdserve.gateway.migration), up to `migration_limit` times."""
        return migrating(self._attempt, req, self.migration_limit, self.on_migration)

    async def _attempt(self, req: GenerateRequest, attempts: int = 2) -> AsyncIterator[RequestOutput]:
        """One placement of a sequence. A replica that fails before the first token (it died, or a
        `ReplicaError`) is retried on another (once, by default), under a new id: the first attempt
        may still be running on a prefill replica. After the first token a replica's failure is
        raised as a `ReplicaError` (`migrating` resumes the sequence elsewhere); an error of the
        request itself (`RequestError`) is never retried. Past `req.deadline_s` the sequence ends
        with `DeadlineExceededError` and its call is cancelled, whatever the replica does."""
        first_id = req.request_id
        for attempt in range(attempts):
            if attempt:
                req = dataclasses.replace(req, request_id=f"{first_id}-retry{attempt}")
            pending = self.channels.register(req.request_id)
            stream = self._generate.remote(req, self.channels.gateway_id)
            reader = asyncio.ensure_future(self._read(stream, pending))
            deadline = None if req.deadline_s is None else asyncio.get_running_loop().call_later(
                max(0.0, req.deadline_s - time.time()), pending.fail,
                DeadlineExceededError("the request did not finish within the gateway's request_timeout_s"))
            streamed = finished = False
            try:
                while True:
                    item = await pending.queue.get()
                    if item is END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    streamed = True
                    finished = item.finished
                    yield item
                    if finished:
                        return
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, OutputChannelError):  # the replica lost our output connection
                    raise UnavailableError(str(e.cause)) from None
                if isinstance(e.cause, ReplicaError) and not streamed and attempt + 1 < attempts:
                    log.warning("decode replica failed %s before it streamed (%r); retrying", first_id, e.cause)
                    continue
                raise e.cause if isinstance(e.cause, Exception) else e from None
            except BackPressureError as e:
                raise OverloadedError(f"the decode pool's queue is full ({e})") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if streamed or attempt + 1 == attempts:
                    raise UnavailableError(f"a decode replica went away mid-request ({type(e).__name__})") from None
                log.warning("decode replica failed before %s streamed (%r); retrying", req.request_id, e)
            except OutputChannelError as e:
                raise UnavailableError(str(e)) from None
            finally:
                if deadline is not None:
                    deadline.cancel()
                self.channels.unregister(pending)
                if finished and not reader.done():  # the call's own end is still on its way
                    self._tails.add(reader)
                    reader.add_done_callback(self._tails.discard)
                else:
                    reader.cancel()
                    try:
                        stream.cancel()  # no-op once finished; frees both pools when the client left
                    except Exception:  # noqa: BLE001 - a call that never reached a replica re-raises its error here
                        pass

    async def _read(self, stream, pending: Pending) -> None:
        """The call's items into `pending`: outputs (no connection yet), an offer to connect, or
        the count of outputs sent over the connection; its error, if it fails."""
        is_direct = True
        try:
            async for item in stream:
                if isinstance(item, ChannelDone):
                    is_direct = False
                    self.channels.done(pending, item)
                elif isinstance(item, ChannelOffer):
                    self.channels.offer(item)
                else:
                    pending.queue.put_nowait(item)
            if is_direct:
                pending.queue.put_nowait(END)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            pending.fail(e)

    def stats(self) -> dict:
        """What this gateway holds: sequences waiting for outputs, output connections open, calls
        whose end is still on its way (each back to zero, or to one connection per engine
        replica, once nothing runs)."""
        return {"num_pending_sequences": self.channels.num_pending, "num_output_connections":
                self.channels.num_connections, "num_call_tails": len(self._tails)}

    async def health(self) -> dict[str, bool]:
        names = list(self.pools)
        results = await asyncio.gather(*(self.pools[n].health.remote() for n in names), return_exceptions=True)
        return {n: r is True for n, r in zip(names, results)}


API_KEYS_ENV = "PDSERVE_API_KEYS"


def with_env_api_keys(gateway: GatewayConfig) -> GatewayConfig:
    """The configured API keys plus the comma-separated ones in $PDSERVE_API_KEYS (how the Helm
    chart passes keys from a Secret, so they never appear in the RayService object)."""
    extra = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if not extra:
        return gateway
    return gateway.model_copy(update={"api_keys": sorted(set(gateway.api_keys) | set(extra))})


@serve.deployment(name="Gateway")
@serve.ingress(api)
class Gateway:
    def __init__(self, config: dict, decode: DeploymentHandle, prefill: "DeploymentHandle | None" = None):
        cfg = ServeConfig.model_validate(config)
        cfg = cfg.model_copy(update={"gateway": with_env_api_keys(cfg.gateway)})
        pools = {"decode" if prefill is not None else "unified": decode}
        if prefill is not None:
            pools["prefill"] = prefill
        # The decode (or unified) pool's engine holds each sequence to its end: its context is the bound.
        max_model_len = cfg.engine_config(cfg.decode).max_model_len or ModelArch.from_dir(cfg.model).context_len
        setup_tracing(cfg.telemetry, "gateway")
        metrics = GatewayMetrics(serve.get_replica_context().replica_id.unique_id, cfg.served_model_name)
        self.client = client = PoolsClient(decode, pools, cfg.gateway.migration_limit, metrics.migration)
        self.service = OpenAIService(client, Tokenizer(cfg.model), cfg.served_model_name, max_model_len, cfg.gateway,
                                     metrics)
        self.service.vetter.start()  # now, not at the first large body: the streams beside it would wait
        self.grpc = GrpcGeneration(self.service, metrics)

    def __del__(self):  # Serve's graceful shutdown; the vetting process also ends when its pipe closes
        if hasattr(self, "service"):
            self.service.close()

    # Routes that do no blocking work are coroutines: a plain `def` would run on a worker thread.
    @api.get("/v1/models")
    async def models(self, request: Request):
        return self.service.models(request)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.service.completions(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.service.chat_completions(request)

    @api.get("/health")
    async def health(self):
        return await self.service.health()

    def stats(self) -> dict:  # through the deployment's handle (no route): what the soak reads
        return {**self.client.stats(), "pid": os.getpid()}

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self.service.tokenize(request)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self.service.detokenize(request)

    @api.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        return self.service.tokenizer_info(request)

    # The API's description, only with gateway.enable_docs.
    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        return self._docs() or JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self):
        return self._docs() or get_swagger_ui_html(openapi_url="/openapi.json", title="pdserve")

    @api.get("/redoc", include_in_schema=False)
    async def redoc(self):
        return self._docs() or get_redoc_html(openapi_url="/openapi.json", title="pdserve")

    def _docs(self):
        """None where the docs are served, else the 404 a route that does not exist gets."""
        if self.service.config.enable_docs:
            return None
        return error_response(APIError(404, "not found (the API docs are off: gateway.enable_docs)",
                                       "invalid_request_error", "not_found"))

    # gRPC (pdserve.proto): Ray Serve's gRPC proxy calls the ingress method named after the RPC,
    # passing `grpc_context` to methods that take it.
    async def Generate(self, request, grpc_context=None):
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):
        async for response in self.grpc.generate_stream(request, grpc_context):
            yield response
