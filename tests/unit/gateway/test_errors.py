"""The one exception -> OpenAI error mapping, the prompt check HTTP and gRPC share, and API keys."""

import json

import pytest

from pdserve.errors import (DeadlineExceededError, InvalidRequestError, OverloadedError, PromptTooLongError,
                            RequestFailedError)
from pdserve.engine.async_engine import EngineDeadError
from pdserve.gateway.auth import ApiKeys
from pdserve.gateway.errors import APIError, UnavailableError, error_response
from pdserve.gateway.openai_service import check_prompt


def _body(resp):
    return json.loads(resp.body)["error"]


def test_error_statuses_and_shape():
    cases = [(InvalidRequestError("temperature must be in [0, 2]", param="temperature"), 400, "temperature"),
             (PromptTooLongError("too long", param="prompt"), 400, "prompt"),
             (APIError(404, "no such model", "NotFoundError", "model_not_found"), 404, None),
             (APIError(401, "bad key", "authentication_error", "invalid_api_key"), 401, None),
             (OverloadedError("queue full"), 503, None),
             (UnavailableError("replica died"), 503, None),
             (EngineDeadError("rank 1 died: gloo connection reset"), 503, None),
             (DeadlineExceededError("too slow"), 504, None),
             (RequestFailedError("sampling failed"), 500, None),
             (RuntimeError("bug"), 500, None)]
    for exc, status, param in cases:
        resp = error_response(exc)
        err = _body(resp)
        assert resp.status_code == status and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["message"]
        assert (resp.headers.get("retry-after") == "1") == (status == 503)
    assert _body(error_response(PromptTooLongError("x", param="prompt")))["code"] == "context_length_exceeded"
    assert _body(error_response(DeadlineExceededError("x")))["code"] == "deadline_exceeded"


def test_a_500_names_no_internals_only_the_request_id():
    err = _body(error_response(RuntimeError("secret /etc/path in KVCache.kv[3]"), "req-7"))
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    assert "req-7" in err["message"] and err["type"] == "internal_server_error"


def test_an_engine_that_died_under_the_request_is_a_503_that_names_no_internals():
    resp = error_response(EngineDeadError("worker rank 1 died: gloo /tmp/x reset"), "req-8")
    err = _body(resp)
    assert resp.status_code == 503 and err["type"] == "service_unavailable"
    assert "gloo" not in err["message"] and "req-8" in err["message"]


def test_check_prompt():
    assert check_prompt([1, 2, 3], None, 10, 100, "prompt") == 7  # chat: the rest of the context
    assert check_prompt([1, 2, 3], 4, 10, 100, "prompt") == 4
    with pytest.raises(PromptTooLongError) as e:
        check_prompt([1, 2, 3], 8, 10, 100, "prompt")
    assert e.value.param == "max_tokens"
    with pytest.raises(PromptTooLongError) as e:
        check_prompt(list(range(10)), 1, 10, 100, "prompt")
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        check_prompt([1, 200], 1, 10, 100, "prompt")
    with pytest.raises(InvalidRequestError, match="empty"):
        check_prompt([], 1, 10, 100, "prompt")


def test_api_keys():
    ApiKeys([]).check("")  # no keys configured: open
    keys = ApiKeys(["k0", "k1"])
    for header in ("Bearer k1", "bearer k0", "BEARER k1", "  Bearer   k1  "):  # the scheme in any case
        keys.check(header)
    for header in ("", "k1", "Bearer k2", "Bearer", "Basic k1", "Bearer k1k1", "Bearer \udcff"):
        with pytest.raises(APIError) as e:
            keys.check(header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
