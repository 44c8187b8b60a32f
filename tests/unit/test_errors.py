"""chatstream/errors.py: the one error hierarchy and how upstream failures map to it."""
from __future__ import annotations

import httpx2
import openai
import pytest
from azure.core.exceptions import ClientAuthenticationError

from chatstream.errors import (UPSTREAM_ERRORS, ApiError, ModerationStop, Rejection, StepFailed, TimeLimit,
                               UpstreamMalformed, from_upstream, invalid_request, retry_after)

REQUEST = httpx2.Request("POST", "http://upstream.test/v1/chat/completions")


def status_error(cls, status: int, body=None, headers=None):
    response = httpx2.Response(status, headers=headers or {}, request=REQUEST)
    return cls("upstream said no", response=response, body=body)


# ------------------------------------------------------------------------------------ the shapes

def test_body_without_param():
    error = ApiError(502, "upstream_error", "it failed", retryable=True)
    assert error.body() == {"error": {"type": "upstream_error", "message": "it failed", "retryable": True}}
    assert error.headers == {} and str(error) == "it failed"


def test_body_with_param_keeps_the_order():
    body = invalid_request("bad", "messages[0].role").body()
    assert list(body["error"]) == ["type", "message", "param", "retryable"]
    assert body == {"error": {"type": "invalid_request", "message": "bad", "param": "messages[0].role",
                              "retryable": False}}


def test_repr_names_status_and_type():
    assert repr(ApiError(400, "x", "m")) == "ApiError(400, 'x', 'm')"
    assert repr(TimeLimit("total_timeout", "t")) == "TimeLimit(504, 'total_timeout', 't')"


def test_rejection():
    error = Rejection(422, "refused by policy")
    assert (error.status, error.type, error.message, error.param, error.retryable) == \
        (422, "rejected", "refused by policy", None, False)
    assert Rejection(413, "long", "prompt_too_long", "messages").body()["error"]["param"] == "messages"


def test_step_failed_names_the_step():
    error = StepFailed("tag_user")
    assert (error.status, error.type, error.step) == (500, "pipeline_error", "tag_user")
    assert error.message == "the pipeline step 'tag_user' failed"
    assert StepFailed("before", "custom").message == "custom"


def test_moderation_stop_time_limit_malformed():
    assert (ModerationStop("rude").status, ModerationStop("rude").type) == (400, "content_filter")
    assert ModerationStop("rude").message == "stopped by moderation: rude"
    limit = TimeLimit("upstream_timeout", "slow")
    assert (limit.status, limit.type, limit.retryable) == (504, "upstream_timeout", True)
    malformed = UpstreamMalformed()
    assert (malformed.status, malformed.type, malformed.retryable) == (502, "upstream_malformed", True)
    assert malformed.message == "the model server sent a malformed chunk"


def test_every_error_is_an_api_error():
    for error in (Rejection(400, "m"), StepFailed("s"), ModerationStop("r"), TimeLimit("t", "m"), UpstreamMalformed()):
        assert isinstance(error, ApiError)


# ------------------------------------------------------------------------------- retry-after

def test_retry_after():
    assert retry_after(httpx2.Headers({"retry-after": "7"})) == {"Retry-After": "7"}
    assert retry_after(httpx2.Headers({"retry-after-ms": "2400"})) == {"Retry-After": "3"}  # rounded up
    assert retry_after(httpx2.Headers({"retry-after-ms": "1e400"})) == {}  # infinite: no header, no crash
    assert retry_after(httpx2.Headers({"retry-after-ms": "10"})) == {"Retry-After": "1"}  # never 0
    assert retry_after(httpx2.Headers({"retry-after-ms": "soon"})) == {}
    assert retry_after(httpx2.Headers({})) == {}
    # retry-after wins over retry-after-ms
    assert retry_after(httpx2.Headers({"retry-after": "3", "retry-after-ms": "9000"})) == {"Retry-After": "3"}


# --------------------------------------------------------------------------- from the upstream

def test_our_own_errors_pass_through():
    error = UpstreamMalformed()
    assert from_upstream(error, "m") is error


def test_no_entra_token():
    error = from_upstream(ClientAuthenticationError("no credential"), "m")
    assert (error.status, error.type, error.retryable) == (503, "upstream_auth_unavailable", True)


def test_timeout():
    error = from_upstream(openai.APITimeoutError(REQUEST), "m")
    assert (error.status, error.type, error.retryable) == (504, "upstream_timeout", True)


def test_connection_before_and_after_output():
    before = from_upstream(openai.APIConnectionError(request=REQUEST), "m")
    after = from_upstream(openai.APIConnectionError(request=REQUEST), "m", midstream=True)
    assert (before.status, before.type, before.retryable) == (503, "upstream_unavailable", True)
    assert (after.status, after.type, after.retryable) == (502, "upstream_disconnected", True)


@pytest.mark.parametrize("cls, status", [(openai.AuthenticationError, 401), (openai.PermissionDeniedError, 403)])
def test_our_credentials_refused_never_quote_the_upstream(cls, status):
    exc = status_error(cls, status, body={"error": {"message": "Incorrect API key provided: sk-abc***xyz"}})
    error = from_upstream(exc, "m")
    assert (error.status, error.type, error.retryable) == (502, "upstream_auth", False)
    assert "sk-" not in error.message


def test_unknown_model():
    error = from_upstream(status_error(openai.NotFoundError, 404), "gpt-x")
    assert (error.status, error.type, error.param) == (400, "model_not_found", "model")
    assert "'gpt-x'" in error.message


def test_rate_limited_keeps_message_and_retry_after():
    exc = status_error(openai.RateLimitError, 429, body={"error": {"message": "slow down"}},
                       headers={"retry-after": "12"})
    error = from_upstream(exc, "m")
    assert (error.status, error.type, error.message, error.retryable) == (429, "rate_limited", "slow down", True)
    assert error.headers == {"Retry-After": "12"}


def test_bad_request_keeps_message_and_param():
    exc = status_error(openai.BadRequestError, 400,
                       body={"error": {"message": "temperature too high", "param": "temperature"}})
    error = from_upstream(exc, "m")
    assert (error.status, error.type, error.message, error.param) == (400, "invalid_request", "temperature too high",
                                                                      "temperature")


def test_unprocessable_is_a_bad_request_and_a_body_without_error_wrapper_is_read():
    exc = status_error(openai.UnprocessableEntityError, 422, body={"message": "bad field", "param": 5})
    error = from_upstream(exc, "m")
    assert (error.status, error.type, error.message, error.param) == (400, "invalid_request", "bad field", None)


def test_bad_request_without_a_body_uses_the_sdk_message():
    error = from_upstream(status_error(openai.BadRequestError, 400, body="not json"), "m")
    assert error.message == "upstream said no" and error.param is None


@pytest.mark.parametrize("status, retryable", [(500, True), (503, True), (408, True), (409, True), (418, False)])
def test_other_statuses(status, retryable):
    error = from_upstream(status_error(openai.APIStatusError, status, body={"error": {"message": "secret detail"}}), "m")
    assert (error.status, error.type, error.retryable) == (502, "upstream_error", retryable)
    assert error.message == f"the model server failed (HTTP {status})"


def test_an_error_event_inside_the_stream():
    error = from_upstream(openai.APIError("overloaded", REQUEST, body=None), "m")
    assert (error.status, error.type, error.retryable) == (502, "upstream_error", True)
    assert error.message == "the model server reported an error: overloaded"


def test_anything_else_is_a_bug():
    with pytest.raises(TypeError, match="not an upstream error: ValueError"):
        from_upstream(ValueError("x"), "m")


def test_upstream_errors_tuple():
    assert issubclass(openai.APIConnectionError, UPSTREAM_ERRORS)
    assert issubclass(ClientAuthenticationError, UPSTREAM_ERRORS)
    assert not issubclass(ApiError, UPSTREAM_ERRORS)
