"""The OpenAI-compatible API over any `GenerateClient` (no Ray here; the deployment plugs in
handles to the pools, tests may plug in a `DecodeServer`).

Each route takes the raw Starlette request and returns a response: it reads the body within a
size limit and a time limit, then, on a worker thread, parses and validates it (bad input -> an
OpenAI-shaped 4xx; `bounds.py` first bounds its shape), applies the chat template, tokenizes and
fans the request out into one `GenerateRequest` per prompt and choice; back on the event loop it
assembles the engine's token outputs into OpenAI responses or SSE chunks. Errors before the
first byte are HTTP errors; errors after it are sent in-stream, followed by `data: [DONE]`.

Nothing a request sends runs on the event loop in proportion to its size: bodies and prompts are
parsed and tokenized on threads (tokenizing lets go of the GIL), bodies over `LARGE_BODY_BYTES`
on a thread of their own, so a large prompt delays only itself and other large ones, never the
streams this gateway serves. Parsing JSON holds the GIL, so bodies over `VET_BODY_BYTES` are
first parsed and bounded in a process of their own (`body_vetter.py`): only a body the bounds
accept is parsed here. Every request carries its deadline (`gateway.request_timeout_s`):
past it the gateway stops waiting, the sequences are cancelled in the pools, and the client gets
a 504 (in-stream once streaming).

A stream sends one chunk per token as it is produced, its text empty or not (a special token,
text held back as a possible stop string's start or an unfinished character), as vLLM does: the
clients that time chunks (`vllm bench serve`, aiperf, `pdserve bench`) then see every token when
it comes, not a gap of two steps before the token after a silent one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import AsyncIterator, Callable, Protocol

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.config import GatewayConfig
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.gateway.auth import ApiKeys
from pdserve.gateway.body_vetter import VET_BODY_BYTES, BodyVetter
from pdserve.gateway.bounds import RequestBounds, check_logit_bias, tokenizer_json
from pdserve.gateway.chat_output import ChatChoiceOutput
from pdserve.gateway.errors import APIError, error_response, outcome_of
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve.gateway.request_body import parse_json_object, parse_json_object_in_pieces, read_body
from pdserve.gateway.reasoning import CLOSED, reasoning_mode, template_thinks
from pdserve.gateway.structured import StructuredOutputChecker
from pdserve.gateway.reasoning_effort import ReasoningEffort
from pdserve.gateway.tools import ToolCalling
from pdserve.gateway.sse import DONE, TextChunks, chat_choice, completion_choice, sse_event
from pdserve.protocol import GenerateRequest
from pdserve.telemetry.requests import RequestRecord

log = logging.getLogger(__name__)

# Bodies larger than this are parsed and tokenized on a thread of their own: a 4 MiB prompt takes
# seconds to tokenize, and must not hold up the many small requests behind it.
LARGE_BODY_BYTES = 256 << 10


class GenerateClient(Protocol):
    """What the gateway needs from the pools."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """An async generator of the sequence's outputs, ending after the finished one; closing it
        early aborts the sequence."""

    async def health(self) -> dict[str, bool]: ...


def check_prompt(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, vocab_size: int,
                 param: str) -> int:
    """Reject empty prompts, unknown token ids and prompt + max_tokens over the context; returns
    max_tokens (None: the rest of the context, as chat completions default)."""
    n = len(prompt_ids)
    if not n:
        raise InvalidRequestError("the prompt is empty", param=param)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary", param=param)
    if max_tokens is None:
        max_tokens = max_model_len - n
    if n + max(max_tokens, 1) > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; you requested {n + max_tokens} "
            f"tokens ({n} in the prompt, {max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
            param=param if max_tokens <= 0 or n >= max_model_len else "max_tokens")
    return max_tokens


def _validation_error(e: ValidationError) -> InvalidRequestError:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    param = str(err["loc"][0]) if err["loc"] else None
    return InvalidRequestError(f"{where}: {err['msg']}" if where else err["msg"], param=param)


@dataclass
class _Choice:
    """One choice being assembled (non-streaming), or its logprob bookkeeping (streaming)."""
    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_cached_tokens: int = 0


class OpenAIService:
    def __init__(self, client: GenerateClient, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 config: GatewayConfig, metrics=None):
        # metrics: a pdserve.telemetry.metrics.GatewayMetrics, or None (no series recorded).
        self.client, self.tokenizer, self.model_name = client, tokenizer, model_name
        self.max_model_len, self.config, self.metrics = max_model_len, config, metrics
        self.api_keys = ApiKeys(config.api_keys)
        self.bounds = RequestBounds.of(config, tokenizer_json(tokenizer), max_model_len)
        self.vetter = BodyVetter(self.bounds)  # parses and bounds bodies over VET_BODY_BYTES out of process
        self.structured = StructuredOutputChecker(tokenizer)  # compiles each constraint once, 400 if bad
        self.tool_calling = ToolCalling(config.tool_call_parser, tokenizer)
        self.reasoning_effort = ReasoningEffort(tokenizer.chat_template)
        self.thinks = config.reasoning_parser == "think" or (config.reasoning_parser == "auto"
                                                              and template_thinks(tokenizer.chat_template))
        self.token_str = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="pdserve-parse")
        self._large_threads = ThreadPoolExecutor(1, thread_name_prefix="pdserve-parse-large")

    def close(self) -> None:
        """End the body-vetting process and the worker threads (the replica is going away)."""
        self.vetter.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._large_threads.shutdown(wait=False, cancel_futures=True)

    # -- plumbing ------------------------------------------------------------------------------
    async def _read(self, request: Request, model: type[BaseModel], prepare: Callable | None = None):
        """Check the key, read the body, then on a worker thread parse and validate it into
        `model` and, with `prepare`, return `prepare(body, cache_salt)` (the request's own work:
        templating, tokenizing, building the sequences, under the prefix-cache salt its key and
        `gateway.cache_isolation` give it) with it: `(body, prepared)`."""
        key_salt = self.api_keys.check(request.headers.get("authorization", ""))
        raw = await read_body(request, self.config.max_body_bytes, self.config.body_read_timeout_s)
        if len(raw) > VET_BODY_BYTES:
            await self.vetter.vet(raw, self.config.body_read_timeout_s)
        return await self.off_loop(len(raw), self._parse, raw, model, prepare, key_salt)

    def cache_salt(self, key_salt: str | None, requested: str | None) -> str | None:
        """The salt a request's blocks carry: under per_key isolation its key's (and its own,
        appended: a client cannot name another key's salt), else the one it asked for."""
        isolation = self.config.cache_isolation or ("per_key" if self.api_keys else "shared")
        if isolation == "per_key" and key_salt is not None:
            return f"{key_salt}:{requested or ''}"
        return requested

    async def off_loop(self, size_bytes: int, fn: Callable, *args):
        """`fn(*args)` on a worker thread: a thread of its own for requests over LARGE_BODY_BYTES."""
        pool = self._large_threads if size_bytes > LARGE_BODY_BYTES else self._threads
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _parse(self, raw: bytes, model: type[BaseModel], prepare: Callable | None, key_salt: str | None = None):
        # A body the vetting process accepted, a piece at a time: the event loop runs between them.
        data = parse_json_object(raw) if len(raw) <= VET_BODY_BYTES else parse_json_object_in_pieces(raw)
        self.bounds.check_counts(data)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        name = getattr(body, "model", None)
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "NotFoundError", "model_not_found")
        if prepare is None:
            return body
        return body, prepare(body, self.cache_salt(key_salt, getattr(body, "cache_salt", None)))

    @staticmethod
    def request_id(request: Request) -> str:
        # Ray Serve's proxy echoes the header (and makes one when absent) on every response. A
        # client's id is kept to 128 printable characters: it reaches logs and engine ids.
        rid = request.headers.get("x-request-id", "")[:128]
        return rid if rid and rid.isprintable() else uuid.uuid4().hex

    def _check_length(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        return check_prompt(prompt_ids, max_tokens, self.max_model_len, self.tokenizer.vocab_size, param)

    def _check_sampling(self, body, *constraint) -> StructuredOutput | None:
        """Checks of the sampling fields before tokenizing; returns the compiled output constraint
        (`constraint`: a chat request's tool grammar and reasoning mode, `StructuredOutputChecker`'s)."""
        body.refuse_unsupported()
        vocab = self.tokenizer.vocab_size
        self.bounds.check_stops(body.stop)
        check_logit_bias(body.logit_bias, vocab)
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise InvalidRequestError(f"stop_token_ids must lie in the vocabulary [0, {vocab})", param="stop_token_ids")
        return self.structured(body, *constraint)

    def _fan_out(self, rec: RequestRecord, rid: str, prompts: list[list[int]], n: int,
                 make_params: Callable[[int], SamplingParams]) -> list[tuple[int, GenerateRequest]]:
        """One sequence per prompt and choice, indexed as OpenAI numbers choices; `make_params(i)`
        gives choice i's sampling parameters. Each carries the request's deadline. (How many there
        may be was checked before the prompts were tokenized: `bounds.check_sequences`.)"""
        tag = uuid.uuid4().hex[:8]  # client ids may repeat; engine ids must not
        deadline_s = rec.start_unix_s + self.config.request_timeout_s
        params = [make_params(i) for i in range(n)]
        return [(p * n + i, GenerateRequest(f"{rid}-{tag}-{p * n + i}", ids, params[i], rec.trace_context, deadline_s))
                for p, ids in enumerate(prompts) for i in range(n)]

    async def _handle(self, request: Request, route: str, run) -> Response:
        """Run one API call under its `RequestRecord`: errors before the first byte become HTTP
        errors; `run(rid, rec)` finishes the record itself when it succeeds (or its stream does)."""
        rid = self.request_id(request)
        rec = RequestRecord(route, rid, request.headers, self.metrics)
        try:
            return await run(rid, rec)
        except Exception as e:  # noqa: BLE001
            rec.finish(outcome_of(e), e)
            return error_response(e, rid)
        except BaseException as e:  # the client left
            rec.finish("aborted", e)
            raise

    async def _merged(self, rec: RequestRecord,
                      reqs: list[tuple[int, GenerateRequest]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All choices' outputs as they come; leaving early cancels every leg."""
        if len(reqs) == 1:  # nothing to merge: no task and queue hop per token
            [(index, req)] = reqs
            async with aclosing(self.client.generate(req)) as outs:
                async for out in outs:
                    rec.output(index, len(out.new_token_ids))
                    yield index, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, req: GenerateRequest):
            try:
                async for out in self.client.generate(req):
                    await queue.put((index, out))
                await queue.put((index, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in reqs]
        try:
            pending = len(tasks)
            while pending:
                index, item = await queue.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    rec.output(index, len(item.new_token_ids))
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _usage(self, choices: list[_Choice], n: int) -> dict:
        prompt = sum(len(c.prompt_ids) for c in choices[::n])
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices[::n])}}

    def _sse(self, rec: RequestRecord, events: AsyncIterator[bytes], usage: Callable[[], dict]) -> StreamingResponse:
        """`events`: the stream's SSE events, serialized (pdserve.gateway.sse)."""
        async def body():
            try:
                async for event in events:
                    yield event
            except Exception as e:  # noqa: BLE001 - after the first byte, errors go in-stream
                rec.finish(outcome_of(e), e)
                resp = error_response(e)
                yield b"data: " + resp.body + b"\n\n"
            except BaseException as e:  # the client left mid-stream
                rec.finish("aborted", e)
                raise
            self._finish_ok(rec, usage())
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream")

    @staticmethod
    def _finish_ok(rec: RequestRecord, usage: dict) -> None:
        rec.finish("ok", None, usage["prompt_tokens"], usage["completion_tokens"])

    async def _collect(self, rec: RequestRecord, reqs, choices: list[_Choice]) -> None:
        async for index, out in self._merged(rec, reqs):
            c = choices[index]
            self._absorb(c, out)
            c.text += out.new_text

    @staticmethod
    def _absorb(c: _Choice, out: RequestOutput) -> None:
        c.token_ids += out.new_token_ids
        c.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            c.logprobs[:0] = out.prompt_logprobs
        if out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            c.num_cached_tokens = out.num_cached_tokens

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/completions", partial(self._completions, request))

    async def _completions(self, request: Request, rid: str, rec: RequestRecord) -> Response:
        body, reqs = await self._read(request, CompletionRequest, partial(self._completion_requests, rid, rec))
        k = body.logprobs
        choices = [_Choice(i, r.prompt_token_ids) for i, r in reqs]
        usage = partial(self._usage, choices, body.n)
        if body.stream:
            return self._sse(rec, self._completion_chunks(rec, rid, body, reqs, choices), usage)
        await self._collect(rec, reqs, choices)
        self._finish_ok(rec, usage())
        return JSONResponse({
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": c.index, "text": (self._echo(c) if body.echo else "") + c.text,
                         "logprobs": self._completion_logprobs(c.logprobs, k, c.prompt_ids[0])
                         if k is not None else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": usage()})

    def _completion_requests(self, rid: str, rec: RequestRecord, body: CompletionRequest, salt: str | None):
        """On a worker thread: the sequences of a validated completions request."""
        prompts = body.prompts()
        self.bounds.check_sequences(len(prompts), body.n)
        structured = self._check_sampling(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        for ids in prompts:
            self._check_length(ids, max_tokens, "prompt")
        k = body.logprobs
        prompt_k = k if body.echo else None  # echo + logprobs: score the prompt too (lm-eval)
        return self._fan_out(rec, rid, prompts, body.n,
                             lambda i: body.sampling_params(max_tokens, k, prompt_k, i, salt, structured))

    def _echo(self, c: _Choice) -> str:
        return self.tokenizer.decode(c.prompt_ids)

    def _completion_logprobs(self, lps: list[TokenLogprob | None], k: int, first_prompt_token: int | None = None,
                             offset: int = 0) -> dict:
        """OpenAI's legacy logprobs object; with echo the prompt's come first (the first has none)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            if lp is None:
                tokens.append(self.token_str(first_prompt_token) if first_prompt_token is not None else None)
                token_lps.append(None)
                tops.append(None)
            else:
                tokens.append(self.token_str(lp.token_id))
                token_lps.append(lp.logprob)
                top = {self.token_str(t): v for t, v in lp.top[:k]}
                top.setdefault(tokens[-1], lp.logprob)
                tops.append(top)
            offsets.append(offset)
            offset += len(tokens[-1] or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _completion_chunks(self, rec: RequestRecord, rid, body: CompletionRequest, reqs,
                                 choices: list[_Choice]):
        created, k = int(time.time()), body.logprobs
        base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": self.model_name}
        plain = TextChunks(base, completion_choice)  # a token's chunk: only its text and index vary
        started = set()
        async for index, out in self._merged(rec, reqs):
            c = choices[index]
            before = len(c.logprobs)
            self._absorb(c, out)
            text = out.new_text
            if body.echo and index not in started:
                text = self._echo(c) + text
            started.add(index)
            if k is None and not out.finished:
                yield plain.event(index, text)  # text or not: see the module's docstring
                continue
            lps = (self._completion_logprobs(c.logprobs[before:] if out.prompt_logprobs is None else c.logprobs, k,
                                             c.prompt_ids[0]) if k is not None else None)
            yield sse_event({**base, "choices": [{"index": index, "text": text, "logprobs": lps,
                                                  "finish_reason": out.finish_reason if out.finished else None,
                                                  "stop_reason": out.stop_reason if out.finished else None}]})
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event({**base, "choices": [], "usage": self._usage(choices, body.n)})

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/chat/completions", partial(self._chat_completions, request))

    async def _chat_completions(self, request: Request, rid: str, rec: RequestRecord) -> Response:
        body, (reqs, k, output) = await self._read(request, ChatCompletionRequest,
                                                   partial(self._chat_requests, rid, rec))
        choices = [_Choice(i, r.prompt_token_ids) for i, r in reqs]
        usage = partial(self._usage, choices, body.n)
        if body.stream:
            return self._sse(rec, self._chat_chunks(rec, rid, body, reqs, choices, k, output), usage)
        await self._collect(rec, reqs, choices)
        self._finish_ok(rec, usage())
        outputs = [output() if output else None for _ in choices]
        return JSONResponse({
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": c.index,
                         "message": o.message(c.text) if o else {"role": "assistant", "content": c.text},
                         "logprobs": self._chat_logprobs(c.logprobs, k) if k is not None else None,
                         "finish_reason": o.finish_reason(c.finish_reason) if o else c.finish_reason,
                         "stop_reason": c.stop_reason} for c, o in zip(choices, outputs)],
            "usage": usage()})

    def _chat_requests(self, rid: str, rec: RequestRecord, body: ChatCompletionRequest, salt: str | None):
        """On a worker thread: the sequences of a validated chat request, its top_logprobs, and
        what makes each choice's output parser (None: the text is the content)."""
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        self.bounds.check_sequences(1, body.n)
        tools = self.tool_calling.plan(body)
        template_kwargs = self.reasoning_effort.template_kwargs(body.reasoning_effort, body.template_kwargs())
        messages = body.template_messages()
        text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt,
                                                  tools.tools if tools else None, **template_kwargs)
        mode = reasoning_mode(text) if self.thinks else None
        after = "" if mode in (None, CLOSED) else mode  # where the constraint starts: after any reasoning
        structured = self._check_sampling(body, tools.grammar if tools else None, after)
        ids = self.tokenizer.encode_prompt_text(text)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._check_length(ids, asked, "messages")
        k = (body.top_logprobs or 0) if body.logprobs else None

        def params(i: int) -> SamplingParams:
            p = body.sampling_params(max_tokens, k, None, i, salt, structured)
            return replace(p, skip_special_tokens=False) if tools and tools.keeps_special_tokens else p

        output = None
        if mode is not None or tools is not None:
            output = partial(ChatChoiceOutput, mode, tools.fmt if tools else None, tools.max_calls if tools else None)
        return self._fan_out(rec, rid, [ids], body.n, params), k, output

    def _chat_logprobs(self, lps: list[TokenLogprob], k: int) -> dict:
        def entry(tid: int, lp: float) -> dict:
            s = self.token_str(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:k]]}
                            for lp in lps]}

    async def _chat_chunks(self, rec: RequestRecord, rid, body: ChatCompletionRequest, reqs,
                           choices: list[_Choice], k, output: Callable[[], ChatChoiceOutput] | None):
        base = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        plain = TextChunks(base, chat_choice)  # a token's chunk: only its text and index vary
        parsers = [output() for _ in choices] if output else None  # reasoning and tool calls read out
        announced = False
        async for index, out in self._merged(rec, reqs):
            if not announced:  # with the first token, as vLLM: a client timing the first chunk times it
                announced = True
                for c in choices:
                    yield sse_event({**base, "choices": [{"index": c.index, "delta": {"role": "assistant",
                                                                                      "content": ""},
                                                          "logprobs": None, "finish_reason": None}]})
            c = choices[index]
            self._absorb(c, out)
            if k is None and not out.finished and parsers is None:
                yield plain.event(index, out.new_text)
                continue
            finish_reason = out.finish_reason if out.finished else None
            if parsers is None:
                delta = {"content": out.new_text} if out.new_text else {}
            else:
                delta = parsers[index].feed(out.new_text, out.finished)
                finish_reason = parsers[index].finish_reason(finish_reason)
            yield sse_event({**base, "choices": [{
                "index": index, "delta": delta,
                "logprobs": self._chat_logprobs(out.new_logprobs, k) if k is not None else None,
                "finish_reason": finish_reason, "stop_reason": out.stop_reason if out.finished else None}]})
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event({**base, "choices": [], "usage": self._usage(choices, body.n)})

    # -- models, health, tokenizer -------------------------------------------------------------
    def models(self, request: Request) -> Response:
        try:
            self.api_keys.check(request.headers.get("authorization", ""))
        except APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": self.model_name, "max_model_len": self.max_model_len}]})

    async def health(self) -> Response:
        """Each pool's state; why one is down is in the logs, not in the answer."""
        try:
            pools = await asyncio.wait_for(self.client.health(), 10)
        except Exception as e:  # noqa: BLE001
            log.warning("health check failed: %r", e)
            pools = {}
        ok = bool(pools) and all(v is True for v in pools.values())
        return JSONResponse({"status": "ok" if ok else "unhealthy",
                             "pools": {name: up is True for name, up in pools.items()}},
                            200 if ok else 503)

    async def tokenize(self, request: Request) -> Response:
        try:
            _, answer = await self._read(request, TokenizeRequest, self._tokenize)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return JSONResponse(answer)

    def _tokenize(self, body: TokenizeRequest, _salt: str | None) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            self.bounds.check_counts({"messages": body.messages})
            ids = self.tokenizer.encode_chat([m.for_template() for m in body.messages], body.add_generation_prompt)
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.token_str(t) for t in ids] if body.return_token_strs else None}

    async def detokenize(self, request: Request) -> Response:
        try:
            _, text = await self._read(request, DetokenizeRequest, self._detokenize)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return JSONResponse({"prompt": text})

    def _detokenize(self, body: DetokenizeRequest, _salt: str | None) -> str:
        bad = next((t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary", param="tokens")
        return self.tokenizer.decode(body.tokens)

    def tokenizer_info(self, request: Request) -> Response:
        try:
            self.api_keys.check(request.headers.get("authorization", ""))
        except APIError as e:
            return error_response(e)
        cfg = self.tokenizer.config
        return JSONResponse({
            "tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "eos_token": self.tokenizer.eos_token, "bos_token": self.tokenizer.bos_token,
            "pad_token": cfg.get("pad_token"), "unk_token": cfg.get("unk_token"),
            "add_bos_token": cfg.get("add_bos_token"), "chat_template": self.tokenizer.chat_template,
            "model_max_length": self.max_model_len, "vocab_size": self.tokenizer.vocab_size})
