"""The gateway's client of the decode pool (`PoolsClient`) over a scripted deployment handle: the
request's deadline ends a sequence wherever the replica is, only replica-level failures are
retried, under a new engine request id, and a replica that dies mid-stream hands the sequence on,
resumed (up to `migration_limit`). Ray's exception types, no Ray cluster."""

from __future__ import annotations

import asyncio
import time

import ray

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DeadlineExceededError, InvalidRequestError, OverloadedError
from pdserve.gateway.deployment import PoolsClient
from pdserve.gateway.errors import UnavailableError
from pdserve.output.frames import OutputChannelError
from pdserve.protocol import GenerateRequest


class ScriptedCall:
    """One `generate.remote(...)` call: yields `outputs` every `gap_s`, then raises `error` if any."""

    def __init__(self, outputs, gap_s: float, error: BaseException | None):
        self.outputs, self.gap_s, self.error, self.cancelled = outputs, gap_s, error, False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for out in self.outputs:
            await asyncio.sleep(self.gap_s)
            yield out
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class ScriptedHandle:
    """A deployment handle whose calls follow `script`: one (outputs, gap_s, error) per call."""

    def __init__(self, script):
        self.script, self.calls, self.request_ids, self.requests = list(script), [], [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req, gateway_id):
        self.request_ids.append(req.request_id)
        self.requests.append(req)
        call = ScriptedCall(*self.script.pop(0))
        self.calls.append(call)
        return call


def _out(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [i], str(i), finished, "length" if finished else None)


def _run(handle, req: GenerateRequest, migration_limit: int = 3) -> tuple[list[RequestOutput], BaseException | None]:
    async def go():
        got = []
        try:
            async for out in PoolsClient(handle, {"decode": handle}, migration_limit).generate(req):
                got.append(out)
        except Exception as e:  # noqa: BLE001
            return got, e
        return got, None

    return asyncio.run(go())


def _request(deadline_in_s: float | None = None) -> GenerateRequest:
    deadline = None if deadline_in_s is None else time.time() + deadline_in_s
    return GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=5), deadline_s=deadline)


def test_the_deadline_ends_a_stream_and_cancels_its_call():
    handle = ScriptedHandle([([_out(i) for i in range(100)], 0.05, None)])
    t0 = time.monotonic()
    got, error = _run(handle, _request(deadline_in_s=0.3))
    assert isinstance(error, DeadlineExceededError) and 2 <= len(got) < 10
    assert time.monotonic() - t0 < 2 and handle.calls[0].cancelled


def test_replica_failures_before_the_first_token_are_retried_under_a_new_id():
    dead = ray.exceptions.RayTaskError("generate", "traceback", OverloadedError("engine full"))
    handle = ScriptedHandle([([], 0, dead), ([_out(1), _out(2, True)], 0, None)])
    got, error = _run(handle, _request())
    assert error is None and [o.new_token_ids for o in got] == [[1], [2]]
    assert handle.request_ids == ["r", "r-retry1"]


def test_a_replica_that_dies_mid_stream_hands_the_sequence_on_resumed():
    died = ray.exceptions.ActorDiedError()
    lost = ray.exceptions.RayTaskError("generate", "traceback", OutputChannelError("connection closed"))
    handle = ScriptedHandle([([_out(1), _out(2)], 0, died), ([_out(3)], 0, lost), ([_out(4), _out(5, True)], 0, None)])
    got, error = _run(handle, _request())
    assert error is None and [o.new_token_ids for o in got] == [[1], [2], [3], [4], [5]]
    assert handle.request_ids == ["r", "r-m1", "r-m2"]
    assert [r.output_token_ids for r in handle.requests] == [[], [1, 2], [1, 2, 3]]
    # Past the limit the replica's failure ends the stream, as without migration.
    handle = ScriptedHandle([([_out(1)], 0, died), ([_out(2)], 0, died)])
    got, error = _run(handle, _request(), migration_limit=1)
    assert isinstance(error, UnavailableError) and len(got) == 2 and handle.request_ids == ["r", "r-m1"]


def test_request_errors_and_failures_after_streaming_are_not_retried():
    bad = ray.exceptions.RayTaskError("generate", "traceback", InvalidRequestError("top_k", param="top_k"))
    handle = ScriptedHandle([([], 0, bad)])
    _, error = _run(handle, _request())
    assert isinstance(error, InvalidRequestError) and handle.request_ids == ["r"]
    late = ray.exceptions.RayTaskError("generate", "traceback", OverloadedError("engine died"))
    handle = ScriptedHandle([([_out(1)], 0, late)])
    got, error = _run(handle, _request(), migration_limit=0)  # (with migration off)
    assert isinstance(error, OverloadedError) and len(got) == 1 and handle.request_ids == ["r"]
