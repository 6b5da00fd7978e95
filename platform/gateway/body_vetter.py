"""Large request bodies parsed and bounded in a process of their own, before the gateway builds
anything from them.

Parsing JSON holds the GIL for the whole call, and what it costs depends on what the body
holds, not only its size: in the gateway's process 4 MiB of `[[],[],...]` (1.4 M lists) held
it ~0.8 s, 50,000 prompts ~90 ms, 4 MiB of text ~5 ms (benchmarks/body_vetting.py). On the
gateway's worker thread that stalls the event loop, and every stream on this gateway with it.
So a body over `VET_BODY_BYTES` first goes to a child process that parses it and runs
`RequestBounds.check_counts` (prompt counts and sizes, messages, stops, constraints): a body
the bounds refuse is answered from the child's verdict without the gateway ever parsing it, and
one they accept is then parsed again by the gateway, at a cost the bounds have limited to what
a servable request holds. Bodies up to `VET_BODY_BYTES` cost at most ~1 ms to parse whatever
they hold, and are parsed in place.

The child speaks a framed pipe protocol, no pickle: the parent writes an 8-byte little-endian
length and the body, the child answers one JSON line: `{}` (accepted), `{"error", "param",
"kind"}` (refused: the error's message, field and class) or `{"fault"}` (a bug, the gateway's 500).
One child a gateway replica, started with it (`start`: its imports take ~0.4 s of a core, which a
replica's first large body would otherwise cost every stream beside it), bodies vetted one at a
time; it exits when its stdin closes (the replica going away), and is started again when it dies
or overruns its time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.gateway.bounds import RequestBounds
from pdserve.gateway.errors import APIError
from pdserve.gateway.request_body import parse_json_object

log = logging.getLogger(__name__)

# The costliest JSON to parse found here, `[[],[],...]`, takes ~70 ns a byte on this CPU class:
# 16 KiB holds the GIL ~1 ms, within a decode step's gap on any accelerator.
VET_BODY_BYTES = 16 << 10
READY = b"ready\n"  # the child's first line: its imports went well
START_TIMEOUT_S = 30.0  # its imports take ~0.4 s here


class BodyVetter:
    def __init__(self, bounds: RequestBounds):
        self._argv = [sys.executable, "-m", "pdserve.gateway.body_vetter", json.dumps(dataclasses.asdict(bounds))]
        self._proc: subprocess.Popen | None = None
        # One thread talks to the child: bodies go one at a time, and an exchange whose caller has
        # gone (a client hanging up) still runs to its verdict, so no verdict answers another body.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-vet")

    def start(self) -> None:
        """Start the child now, in the background: bodies wait behind it. A start that fails is
        logged here and tried again at the first body (whose request then gets the error)."""
        self._thread.submit(self._started).add_done_callback(_log_failed_start)

    async def vet(self, raw: bytes, timeout_s: float) -> None:
        """Raise the `InvalidRequestError` the bounds give `raw`, or return: it may be parsed.
        A child that dies on a body is started again and given it once more; dying twice, or
        not answering within `timeout_s`, is the body's fault (a 400 or 408; the child is replaced)."""
        verdict = await asyncio.get_running_loop().run_in_executor(self._thread, self._vet, raw, timeout_s)
        if "error" in verdict:
            error = PromptTooLongError if verdict["kind"] == "PromptTooLongError" else InvalidRequestError
            raise error(verdict["error"], param=verdict["param"])
        if "fault" in verdict:
            raise RuntimeError(f"the body-vetting process failed on a body: {verdict['fault']} (see its log)")

    def _vet(self, raw: bytes, timeout_s: float) -> dict:
        for attempt in range(2):
            proc = self._started()
            deadline = time.monotonic() + timeout_s
            try:
                _write(proc.stdin, len(raw).to_bytes(8, "little"), deadline)
                _write(proc.stdin, raw, deadline)
                line = _read_line(proc.stdout, deadline)
            except TimeoutError:
                self._end_child()
                raise APIError(408, f"the request body could not be parsed within {timeout_s:g} s",
                               "invalid_request_error", "request_timeout") from None
            if line:
                return json.loads(line)
            log.warning("the body-vetting process died on a %d-byte body (attempt %d); starting another",
                        len(raw), attempt + 1)
            self._end_child()
        raise InvalidRequestError("the request body could not be parsed")

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is not None:
            self._end_child()  # it died between bodies: its pipes go with it
        if self._proc is None:
            proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            os.set_blocking(proc.stdin.fileno(), False)
            try:
                ready = _read_line(proc.stdout, time.monotonic() + START_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            if ready != READY:  # its imports failed: not any body's fault
                _end(proc)
                raise RuntimeError(f"the body-vetting process exited ({proc.returncode}) before it was ready; "
                                   "its error is in this replica's log")
            self._proc = proc
            log.info("started the body-vetting process (pid %d)", proc.pid)
        return self._proc

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._end_child()

    def _end_child(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)


def _log_failed_start(started) -> None:
    if not started.cancelled() and started.exception() is not None:
        log.error("the body-vetting process did not start: %s", started.exception())


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def _write(pipe, data: bytes, deadline: float) -> None:
    """All of `data` into a non-blocking pipe by `deadline` (TimeoutError), or until the reader is
    gone (BrokenPipeError, left for `_read_line` to see as the end of the child)."""
    view = memoryview(data)
    while view:
        if not select.select([], [pipe], [], max(0.0, deadline - time.monotonic()))[1]:
            raise TimeoutError
        try:
            view = view[os.write(pipe.fileno(), view[:1 << 20]):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            return


def _read_line(pipe, deadline: float) -> bytes:
    """One line from `pipe` by `deadline` (TimeoutError); b"" if the writer is gone first."""
    line = bytearray()
    while not line.endswith(b"\n"):
        if not select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            return b""
        line += chunk
    return bytes(line)


def _serve(bounds: RequestBounds) -> None:
    """The child's loop: a verdict for each framed body until stdin closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(READY)
    stdout.flush()
    while len(head := stdin.read(8)) == 8:
        raw = stdin.read(int.from_bytes(head, "little"))
        try:
            bounds.check_counts(parse_json_object(raw))
            verdict = {}
        except InvalidRequestError as e:
            verdict = {"error": e.message, "param": e.param, "kind": type(e).__name__}
        except Exception as e:  # noqa: BLE001 - a bug here, not the body's fault: the gateway's 500
            log.exception("vetting a %d-byte body failed", len(raw))
            verdict = {"fault": type(e).__name__}
        stdout.write(json.dumps(verdict).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s body-vetter %(levelname)s %(message)s")
    _serve(RequestBounds(**json.loads(sys.argv[1])))
