"""Exception types (never messages) choose the HTTP status, type and code."""

from __future__ import annotations

import json

import pytest

from kvwarm import errors as e
from kvwarm.server.errors import HTTPError, error_response, kind_of


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (e.ContextOverflowError("too long", n_tokens=10, n_ctx=5), 400, "context_length_exceeded"),
        (e.GrammarError("bad"), 400, "invalid_grammar"),
        (e.InvalidRequestError("bad", param="top_p"), 400, "invalid_value"),
        (e.UnknownModelError("nope"), 404, "model_not_found"),
        (e.ModelNotFoundError("nope"), 404, "model_not_found"),
        (e.ModelExistsError("twice"), 409, "model_exists"),
        (e.ModelBusyError("in use"), 409, "model_busy"),
        (e.ModelCapacityError("full"), 503, "model_capacity"),
        (e.QueueFullError("busy"), 429, "queue_full"),
        (e.EngineClosedError("closed"), 503, "engine_closed"),
        (e.StateRestoreError("blob"), 500, "backend_error"),
        (e.CacheIOError("disk full"), 507, "cache_io_error"),
        (e.CacheKeyError("k"), 404, "cache_key_not_found"),
        (e.KvwarmError("other"), 500, "internal_error"),
        (RuntimeError("a bug"), 500, "internal_error"),
    ],
)
def test_status_follows_the_type(exc: BaseException, status: int, code: str) -> None:
    assert (kind_of(exc).status, kind_of(exc).code) == (status, code)
    response = error_response(exc)
    assert response.status_code == status
    body = json.loads(bytes(response.body))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code


def test_messages_do_not_change_the_mapping() -> None:
    # A message that *mentions* another error must not be mistaken for it.
    assert kind_of(e.BackendError("context length exceeded; model not found")).status == 500


def test_param_queue_retry_and_internal_details() -> None:
    body = json.loads(bytes(error_response(e.InvalidRequestError("x", param="stop")).body))
    assert body["error"]["param"] == "stop"
    assert error_response(e.QueueFullError("busy")).headers["retry-after"] == "1"
    # A cluster's replica lost is worth asking again; one stuck past its deadline is not.
    assert error_response(e.ReplicaUnavailableError("lost")).headers["retry-after"] == "1"
    assert "retry-after" not in error_response(e.ReplicaTimeoutError("stuck")).headers
    hidden = json.loads(bytes(error_response(RuntimeError("secret path /x")).body))
    assert "secret" not in hidden["error"]["message"]
    custom = error_response(HTTPError(413, "too big", code="request_too_large"))
    assert custom.status_code == 413


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (e.UnknownModelError("nope"), 404, "not_found_error"),
        (e.QueueFullError("busy"), 429, "rate_limit_error"),
        # Anthropic's status for overloaded_error (its SDK's OverloadedError), not a 503.
        (e.ModelCapacityError("full"), 529, "overloaded_error"),
        (e.EngineClosedError("closed"), 529, "overloaded_error"),
        # Anthropic's type for a 504 (its SDK's gateway timeout error); it said api_error.
        (e.ReplicaTimeoutError("stuck"), 504, "timeout_error"),
        (e.KvwarmError("other"), 500, "api_error"),
    ],
)
def test_anthropic_error_types_follow_the_status(
    exc: BaseException, status: int, kind: str
) -> None:
    response = error_response(exc, "/v1/messages")
    assert response.status_code == status
    body = json.loads(bytes(response.body))
    assert body == {"type": "error", "error": {"type": kind, "message": str(exc)}}


def test_an_anthropic_529_keeps_its_retry_after_and_openai_stays_503() -> None:
    busy = error_response(e.ModelCapacityError("full"), "/v1/messages")
    assert (busy.status_code, busy.headers["retry-after"]) == (529, "1")
    loading = HTTPError(503, "loading", code="model_loading", headers={"Retry-After": "1"})
    raised = error_response(loading, "/v1/messages")
    assert (raised.status_code, raised.headers["retry-after"]) == (529, "1")
    assert json.loads(bytes(raised.body))["error"]["type"] == "overloaded_error"
    # /v1/models speaks Anthropic's dialect to an Anthropic client only.
    assert error_response(loading, "/v1/models", anthropic=True).status_code == 529
    for path in ("/v1/chat/completions", "/v1/models", "/v1/responses"):
        assert error_response(loading, path).status_code == 503
        assert error_response(e.ModelCapacityError("full"), path).status_code == 503
