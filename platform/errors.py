"""Typed errors shared by every role.

Bad input raises an `InvalidRequestError` (or a subclass) naming the offending parameter; the
gateway maps these once to OpenAI-shaped HTTP errors. Loading problems raise `ModelLoadError`.
Nothing here knows about HTTP or Ray.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """A request the caller can fix: bad sampling parameters, empty or too-long prompts."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # keep `param` when Ray pickles the error between replicas
        return type(self), (self.message, self.param)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class OverloadedError(PdserveError):
    """No room for the request right now (queue or KV cache full); retry later or elsewhere."""

    retry_after_s = 1


class ModelLoadError(PdserveError):
    """A checkpoint could not be loaded: missing files, a bad config, unsupported architecture."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or one of its options is not implemented."""


class AddressUnavailableError(PdserveError):
    """`pdserve serve` cannot listen on its HTTP address: another process holds it, or the host
    is not this machine's, or the port is privileged."""
