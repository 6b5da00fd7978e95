"""The typed split of errors: request-level (never retried) versus replica-level (retryable
elsewhere), and every error keeps its type and attributes through pickling (Ray's)."""

import pickle

import pytest

from pdserve.engine.async_engine import EngineDeadError
from pdserve.errors import (DeadlineExceededError, InvalidRequestError, OverloadedError, PromptTooLongError,
                            ReplicaError, RequestError, RequestFailedError)
from pdserve.kvtransfer.protocol import (ExporterUnreachableError, KVTransferError, LayoutMismatchError,
                                         LeaseExpiredError)

REQUEST_ERRORS = [InvalidRequestError("bad top_k", param="top_k"), PromptTooLongError("too long", param="prompt"),
                  RequestFailedError(), DeadlineExceededError()]
REPLICA_ERRORS = [OverloadedError("queue full"), EngineDeadError("the engine loop died"),
                  ExporterUnreachableError("gone"), LeaseExpiredError("expired")]


@pytest.mark.parametrize("error", REQUEST_ERRORS + REPLICA_ERRORS, ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_with_their_attributes(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.retryable == error.retryable
    if isinstance(error, InvalidRequestError):
        assert (again.param, again.message) == (error.param, error.message)


def test_request_errors_are_never_retryable_and_replica_errors_are():
    assert all(isinstance(e, RequestError) and not e.retryable for e in REQUEST_ERRORS)
    assert all(isinstance(e, ReplicaError) and e.retryable for e in REPLICA_ERRORS)
    assert not any(isinstance(e, ReplicaError) for e in REQUEST_ERRORS)
    assert not any(isinstance(e, RequestError) for e in REPLICA_ERRORS)
    # Transfer errors another attempt cannot cure stay neither (and not retryable).
    assert not isinstance(LayoutMismatchError("x"), ReplicaError) and not LayoutMismatchError("x").retryable
    assert isinstance(LeaseExpiredError("x"), KVTransferError)


def test_a_failed_request_keeps_its_cause_out_of_its_message():
    cause = RuntimeError("internal detail: tensor of shape [3, 512]")
    error = RequestFailedError()
    error.__cause__ = cause
    assert "internal detail" not in str(error) and error.__cause__ is cause
    assert "internal detail" not in str(pickle.loads(pickle.dumps(error)))
