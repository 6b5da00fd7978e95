"""Large bodies are parsed and bounded in a child process: its verdicts are the bounds' own, the
gateway's event loop runs while it parses, and a child that dies, hangs, fails to start or is
abandoned mid-body is replaced without its verdict answering another body."""

import asyncio
import sys

import pytest

from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.gateway.body_vetter import BodyVetter
from pdserve.gateway.bounds import RequestBounds
from pdserve.gateway.errors import APIError
from tests.fakes.ticker import ticking

BOUNDS = RequestBounds(max_prompts=3, max_sequences=6, max_n=2, max_stops=2, max_stop_chars=5,
                       max_stop_token_ids=2, max_logit_bias=2, max_messages=2, max_prompt_chars=10,
                       max_prompt_tokens=4)
EMPTY_PROMPTS = b'{"prompt": [' + b",".join([b"[]"] * 1_390_000) + b"]}"  # ~4 MiB, ~0.3 s to parse


def vetting(*bodies: bytes, vetter: BodyVetter | None = None, timeout_s: float = 30.0) -> list:
    """Each body's verdict in turn on one event loop: None (it may be parsed) or the exception."""
    vetter = vetter or BodyVetter(BOUNDS)

    async def run():
        out = []
        for body in bodies:
            try:
                out.append(await vetter.vet(body, timeout_s))
            except Exception as e:  # noqa: BLE001
                out.append(e)
        vetter.close()
        return out

    return asyncio.run(run())


def test_verdicts_are_the_bounds_and_the_parsers():
    ok, long_text, long_ids, many, surrogate, deep, bad, not_object = vetting(
        b'{"prompt": "hi", "stop": ["a"]}', b'{"prompt": "' + b"x" * 11 + b'"}', b'{"prompt": [1,2,3,4,5]}',
        EMPTY_PROMPTS, b'{"prompt": "a\\ud800"}', b'{"prompt":' * 100_000 + b"1" + b"}" * 100_000, b'{"prompt": ',
        b"[1]")
    assert ok is None
    assert type(long_text) is InvalidRequestError and long_text.param == "prompt"
    assert type(long_ids) is PromptTooLongError and long_ids.param == "prompt"
    assert isinstance(many, InvalidRequestError) and many.param == "prompt" and "1390000" in many.message
    for e, words in [(surrogate, "surrogate"), (deep, "nested too deeply"), (bad, "not valid JSON"),
                     (not_object, "JSON object")]:
        assert isinstance(e, InvalidRequestError) and words in e.message and e.param is None


def test_the_event_loop_runs_while_a_costly_body_is_parsed():
    """Parsed on the gateway's thread, this body would hold the GIL for its whole parse (~0.3 s)
    and no tick could run meanwhile."""
    async def run():
        vetter = BodyVetter(BOUNDS)
        await vetter.vet(b"{}", 30)  # started
        async with ticking() as ticks:
            with pytest.raises(InvalidRequestError):
                await vetter.vet(EMPTY_PROMPTS, 30)
            during = ticks.count
        vetter.close()
        return during

    assert asyncio.run(run()) >= 10


def _child(code: str) -> BodyVetter:
    """A vetter whose child runs `code` instead of the real vetting loop."""
    vetter = BodyVetter(BOUNDS)
    vetter._argv = [sys.executable, "-c", code]
    return vetter


READY = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); "


def test_started_ahead_the_child_serves_the_first_body():
    async def run():
        vetter = BodyVetter(BOUNDS)
        vetter.start()
        for _ in range(300):
            if vetter._proc is not None:
                break
            await asyncio.sleep(0.1)
        started = vetter._proc
        assert started is not None and started.poll() is None  # up before any body came
        assert await vetter.vet(b"{}", 30) is None and vetter._proc is started
        vetter.close()

    asyncio.run(run())


def test_a_child_that_cannot_start_ahead_fails_the_first_body_instead(caplog):
    vetter = _child("import sys; sys.exit(3)")
    vetter.start()
    [e] = vetting(b"{}", vetter=vetter)
    assert type(e) is RuntimeError and "before it was ready" in str(e)
    assert "did not start" in caplog.text


def test_a_child_killed_between_bodies_is_replaced():
    async def run():
        vetter = BodyVetter(BOUNDS)
        await vetter.vet(b"{}", 30)
        first = vetter._proc
        first.kill()
        first.wait()
        with pytest.raises(InvalidRequestError, match="characters"):
            await vetter.vet(b'{"prompt": "' + b"x" * 11 + b'"}', 30)
        assert vetter._proc is not first and vetter._proc.poll() is None
        vetter.close()

    asyncio.run(run())


def test_a_body_the_child_dies_on_twice_is_a_400():
    [e] = vetting(b"{}", vetter=_child(READY + "sys.stdin.buffer.read(9); sys.exit(1)"))
    assert type(e) is InvalidRequestError and "could not be parsed" in e.message


def test_a_child_that_does_not_answer_is_a_408_and_replaced():
    vetter = _child(READY + "sys.stdin.buffer.read(9); time.sleep(60)")
    [e] = vetting(b"{}", vetter=vetter, timeout_s=0.5)
    assert isinstance(e, APIError) and e.status == 408 and vetter._proc is None


def test_a_child_that_cannot_start_is_a_server_fault_not_the_bodys():
    [e] = vetting(b"{}", vetter=_child("import sys; sys.exit(3)"))
    assert type(e) is RuntimeError and "before it was ready" in str(e)


def test_a_body_abandoned_mid_parse_does_not_answer_the_next():
    """The client of a costly body goes away while the child parses it; the next body must get
    its own verdict, not the abandoned one's."""
    async def run():
        vetter = BodyVetter(BOUNDS)
        await vetter.vet(b"{}", 30)
        abandoned = asyncio.create_task(vetter.vet(EMPTY_PROMPTS, 30))
        await asyncio.sleep(0.05)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        with pytest.raises(InvalidRequestError, match="stop sequence"):
            await vetter.vet(b'{"stop": "' + b"x" * 6 + b'"}', 30)
        assert await vetter.vet(b"{}", 30) is None
        vetter.close()

    asyncio.run(run())
