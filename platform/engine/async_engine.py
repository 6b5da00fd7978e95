"""`AsyncLLMEngine`: the engine behind an asyncio API, for the serving replicas.

The step loop runs on a thread of its own, so a replica's event loop stays free to accept
requests while the model computes. `generate(...)` validates and queues a request (bad input
raises at once, before anything is queued) and returns an async iterator of `RequestOutput`s,
which ends after the output marked `finished`. Leaving the iterator early (client gone, task
cancelled) aborts the request and frees its KV blocks. A request the engine ended on its own (a
step failed for it alone, or its deadline passed: `LLMEngine.take_failed_requests`) raises that
`RequestError` in its stream, after the step's other outputs; every other stream goes on. If the
loop itself fails (the model or the device), every open stream raises `EngineDeadError` and
`is_healthy` turns False. With `forward`, a stream's outputs before the finished one go to
`forward(out)` on the caller's event loop as the step delivers them, and the iterator yields only
what `forward` did not take (an output queued before it, the finished one, errors): a replica
passing outputs on to a connection wakes no task per token.

Contract: one lock guards the engine, so `add_request`, `abort_request` and `step` never
interleave. Calls from an event loop (`generate`, `resume`, `call`, a stream's end) never wait
for a running step: when the engine is mid-step they are queued and the loop thread runs them
right after it, so a replica's event loop keeps delivering every other stream's tokens meanwhile
(waiting on the lock blocked it for up to a whole step: a long prefill's second or more). `locked`
waits for the lock, for threads other than event loops. No Ray here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable, Sequence, TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.engine.grammar import GrammarError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError, ReplicaError

log = logging.getLogger(__name__)
T = TypeVar("T")
Forward = Callable[[RequestOutput], None]


class EngineDeadError(ReplicaError):
    """The engine loop stopped on an error; the replica must be replaced. Retryable elsewhere.
    Its message is public; the failure itself is its `__cause__` and in the replica's log."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.RLock()  # re-entrant: a queued call may use `locked` callbacks (lease pins)
        self._calls: deque = deque()  # (fn, args, loop, future or None), run by the loop thread between steps
        self._has_work = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        # request id -> (the caller's event loop, the stream's queue, its forward or None)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Forward | None]] = {}
        # Resumed requests' first outputs, held until the request joins the batch (loop thread only).
        self._held_firsts: dict[str, RequestOutput] = {}
        engine.on_join = self._release_firsts
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def stats(self) -> dict:
        """What the router, autoscaler and tests read from a replica."""
        e = self.engine
        s = e.scheduler
        hits, computed = s.num_prefix_hit_tokens, s.num_computed_prompt_tokens
        return {"healthy": self.is_healthy, "num_unfinished_requests": e.num_unfinished_requests,
                "num_waiting": s.num_waiting, "num_running": len(s.running),
                "queued_prefill_tokens": s.num_queued_prefill_tokens(),
                "num_kv_blocks": e.block_pool.num_blocks, "num_free_kv_blocks": e.num_free_kv_blocks,
                "num_preemptions": s.num_preemptions, "num_aborted_requests": s.num_aborted,
                "num_prefix_hit_tokens": hits,
                "num_computed_prompt_tokens": computed, "num_prefix_query_tokens": hits + computed,
                "prefix_hit_rate": hits / (hits + computed) if hits + computed else 0.0,
                # Share of the cache requests hold (free cached blocks count as free).
                "kv_usage": 1.0 - e.num_free_kv_blocks / e.block_pool.num_blocks}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prefill_only: bool = False, forward: Forward | None = None,
                       prefill_pause_s: float = 0.0, deadline_s: float | None = None,
                       output_token_ids: Sequence[int] = (), max_chunk_tokens: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request (raising on bad input, or a `deadline_s` already past: see
        `LLMEngine.add_request`; with `output_token_ids`, resumed after them) and return its
        stream of outputs."""
        await self.prepare(params)
        return await self._open_stream(request_id, self.engine.add_request, request_id, prompt_token_ids, params,
                                       prefill_only, prefill_pause_s, deadline_s, output_token_ids, max_chunk_tokens,
                                       forward=forward)

    async def resume(self, request_id: str, recompute: bool = False, first: RequestOutput | None = None,
                     forward: Forward | None = None) -> AsyncIterator[RequestOutput]:
        """The stream of a request set up with `engine.add_prefilled_request` once its KV is in
        place (or, with `recompute`, could not be pulled); it opens with `first` when given (the
        prefill's output, not yet sent): at once, or, when the request must wait for a sequence
        slot, as it joins the batch, so the stream runs at the batch's pace from its first token
        (with `recompute`, at once). Its deadline is the one given to `add_prefilled_request`."""
        return await self._open_stream(request_id, self.engine.start_prefilled_request, request_id, recompute,
                                       first=first, hold_first=not recompute, forward=forward)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's structured output on a worker thread unless the engine has it
        cached, so admitting the request never compiles on the step loop. A grammar that does not
        compile raises `InvalidRequestError` here."""
        spec = params.structured
        grammars = self.engine.grammars
        if spec is None or grammars.is_cached(spec):
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, grammars.compile, spec)
        except GrammarError as e:
            raise InvalidRequestError(f"invalid structured output: {e}", param="structured_outputs") from None

    def locked(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` under the engine lock, between steps (KV bookkeeping from other threads)."""
        with self._lock:
            return fn(*args)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` between steps without blocking the caller's event loop: at once when no step
        is running, else on the loop thread right after the current step. Its exception is raised
        here. It runs to completion even when the caller is cancelled, and the cancellation is
        raised only after that, so the caller's cleanup sees what it did. Calls (and `call_soon`s)
        run in the order they were made. A dead engine takes none: it would reserve blocks (a
        decode replica's KV pull) for requests it can never run."""
        if not self.is_healthy:
            raise EngineDeadError("the engine loop is not running; retry on another replica") from self._error
        if not self._calls and self._lock.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self._lock.release()
        future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, args, asyncio.get_running_loop(), future))
        self._has_work.set()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                await asyncio.wait([future])
            raise

    def call_soon(self, fn: Callable, *args) -> None:
        """`fn(*args)` between steps, without waiting for it (now when no step is running); from any
        thread."""
        if not self._calls and self._lock.acquire(blocking=False):
            try:
                fn(*args)
            finally:
                self._lock.release()
            return
        self._calls.append((fn, args, None, None))
        self._has_work.set()

    async def _open_stream(self, request_id: str, add: Callable, *args, first: RequestOutput | None = None,
                           hold_first: bool = False, forward: Forward | None = None) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy:
            raise EngineDeadError("the engine loop is not running; retry on another replica") from self._error
        queue: asyncio.Queue = asyncio.Queue()
        if first is not None and not hold_first:
            queue.put_nowait(first)
        loop = asyncio.get_running_loop()

        def open_():
            add(*args)
            self._streams[request_id] = (loop, queue, forward)
            if first is not None and hold_first:  # (it waits for a slot: else it joins at the next step)
                if self.engine.scheduler.waits_for_a_slot(request_id):
                    self._held_firsts[request_id] = first
                else:
                    queue.put_nowait(first)  # (nobody reads the queue yet: from any thread)

        try:
            await self.call(open_)
        except asyncio.CancelledError:  # it was added all the same: nobody will read it
            self.call_soon(self._drop, request_id)
            raise
        self._has_work.set()
        return self._stream(request_id, queue)

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._held_firsts.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _release_firsts(self, request_ids: list[str]) -> None:
        """The held first outputs of requests joining the batch, before the step runs (loop thread;
        a closed caller's streams are dropped after the step, not inside it)."""
        items = [(self._streams.get(rid), self._held_firsts.pop(rid)) for rid in request_ids
                 if rid in self._held_firsts]
        self._hand_off(items, drop_closed=False)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                # Outputs that piled up while the consumer was busy go out as one: fewer messages
                # down the pipeline under load, and no token waits for a later one.
                while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        raise later
                    item.merge(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if finished:  # the engine is done with it; the loop thread only reads this dict
                self._streams.pop(request_id, None)
            else:
                self.call_soon(self._drop, request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request from any thread; its stream ends with a `finish_reason` of "abort"."""
        with self._lock:
            aborted = self.engine.abort_request(request_id)
            stream = self._streams.get(request_id)
            self._held_firsts.pop(request_id, None)
        if aborted and stream is not None:
            loop, queue, _ = stream
            out = RequestOutput(request_id, [], "", True, "abort")
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # that caller's event loop is already closed
                self._streams.pop(request_id, None)
        return aborted

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; open streams end with `EngineDeadError`."""
        self._stopping = True
        self._has_work.set()
        self._thread.join(timeout_s)
        self._fail_all(EngineDeadError("the engine was shut down"))
        if not self._thread.is_alive():  # the loop is out of the engine: its ranks can stop
            self.engine.shutdown()

    # -- the loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    self._run_calls()
                    is_idle = not self.engine.has_unfinished_requests()
                    if not is_idle:
                        outputs = self.engine.step()
                        # A held first output goes before the request's next (it recomputed instead of
                        # joining): none is lost.
                        targets = [(self._streams.get(o.request_id), held) for o in outputs
                                   if (held := self._held_firsts.pop(o.request_id, None)) is not None] \
                            if self._held_firsts else []
                        targets += [(self._streams.get(o.request_id), o) for o in outputs]
                        # Requests the step ended with an error (aborted already): each stream raises its own.
                        for rid, e in self.engine.take_failed_requests():
                            self._held_firsts.pop(rid, None)
                            targets.append((self._streams.get(rid), e))
                if is_idle:
                    self._has_work.wait(timeout=0.5)
                    self._has_work.clear()
                    continue
                self._hand_off(targets)
        except BaseException as e:  # noqa: BLE001 - any failure kills the replica's engine
            log.exception("engine loop died")
            self._error = e
            dead = EngineDeadError("the engine loop died; retry on another replica")
            dead.__cause__ = e  # logged above; not in the message, which clients may see
            self._fail_all(dead)

    def _hand_off(self, targets: list, drop_closed: bool = True) -> None:
        """Outputs (or errors) to their streams: one hand-off per event loop, so its streams wake in
        the same loop turn and what they pass on (a replica's output connection) leaves as one
        message."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, out in targets:
            if stream is not None:
                loop, queue, forward = stream
                by_loop.setdefault(loop, []).append((queue, forward, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that caller's event loop is closed: nobody reads these
                if drop_closed:
                    self._drop_streams_of(loop)

    def _drop_streams_of(self, loop: asyncio.AbstractEventLoop) -> None:
        """Abort the requests streaming to `loop` (closed), freeing their KV."""
        with self._lock:
            for request_id in [rid for rid, (stream_loop, _, _) in self._streams.items() if stream_loop is loop]:
                self._drop(request_id)

    def _run_calls(self) -> None:
        """The queued calls, in order (loop thread, under the lock)."""
        while self._calls:
            fn, args, loop, future = self._calls.popleft()
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
                if future is None:
                    log.exception("engine call %s failed", getattr(fn, "__name__", fn))
            if future is not None:
                _settle_soon(loop, future, result, error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            while self._calls:  # never run now: their callers get the error
                _, _, loop, future = self._calls.popleft()
                if future is not None:
                    _settle_soon(loop, future, None, error)
            streams = list(self._streams.items())
            self._held_firsts.clear()
            for request_id, _ in streams:
                self.engine.abort_request(request_id)
        for _, (loop, queue, _) in streams:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:  # that caller's event loop is already closed
                pass


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
    def settle():
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that caller's event loop is already closed
        pass


def _deliver(items: list[tuple[asyncio.Queue, Forward | None, RequestOutput | Exception]]) -> None:
    for queue, forward, out in items:
        # An output goes around the queue only while nothing waits in it (order), and never the
        # finished one or an error: the stream's reader ends the request.
        if forward is None or isinstance(out, Exception) or out.finished or not queue.empty():
            queue.put_nowait(out)
            continue
        try:
            forward(out)
        except Exception as e:  # noqa: BLE001 - the reader raises it (its connection closed)
            queue.put_nowait(e)
