"""Typed errors shared by every role.

One split decides what happens to a failed request:

- `RequestError`: the request's own fault or fate (`retryable` False). It is never retried on
  another replica and never kills anything: `InvalidRequestError` (bad input, naming the
  offending parameter; `PromptTooLongError`), `RequestFailedError` (a step failed for this one
  request, which was aborted while the engine went on) and `DeadlineExceededError`.
- `ReplicaError`: the replica failed, not the request (`retryable` True): it may succeed
  elsewhere. `OverloadedError`, the engine's `EngineDeadError`, and the KV transfer errors that
  another attempt may cure (`pdserve.kvtransfer.protocol`).

Loading problems raise `ModelLoadError`. Every error here survives pickling (Ray carries them
between replicas) with its attributes. The gateway maps them once to OpenAI-shaped HTTP errors;
nothing here knows about HTTP or Ray.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class RequestError(PdserveError):
    """The request's own fault or fate: never retried elsewhere, never kills anything."""

    retryable = False


class ReplicaError(PdserveError):
    """The replica failed, not the request: the request may succeed on another replica."""

    retryable = True


class InvalidRequestError(RequestError, ValueError):
    """A request the caller can fix: bad sampling parameters, empty or too-long prompts."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # keep `param` when Ray pickles the error between replicas
        return type(self), (self.message, self.param)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class RequestFailedError(RequestError):
    """A step failed on this one request (sampling, detokenizing, a stop check): the request was
    aborted and the engine went on. The message is short and safe to show a client; the cause
    stays in `__cause__` and in the engine's log under the request id."""

    def __init__(self, message: str = "the engine failed on this request and aborted it"):
        super().__init__(message)


class DeadlineExceededError(RequestError):
    """The request's deadline passed: it was aborted wherever it was, and freed what it held."""

    def __init__(self, message: str = "the request's deadline passed"):
        super().__init__(message)


class OverloadedError(ReplicaError):
    """No room for the request right now (queue or KV cache full); retry later or elsewhere."""


class ModelLoadError(PdserveError):
    """A checkpoint could not be loaded: missing files, a bad config, unsupported architecture."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or one of its options is not implemented."""


class ConfigError(PdserveError):
    """A config with problems: the message explains every one (as `pdserve config validate`)."""


class AddressUnavailableError(PdserveError):
    """`pdserve serve` cannot listen on its HTTP address: another process holds it, or the host
    is not this machine's, or the port is privileged."""
