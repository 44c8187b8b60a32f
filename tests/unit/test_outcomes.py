"""chatstream/upstreams/outcomes.py: one classifier for every upstream failure: what the caller is
told (the ApiError) and what the pool records for the entry (the Outcome)."""

from __future__ import annotations

import httpx2
import openai
import pytest
from azure.core.exceptions import ClientAuthenticationError

from chatstream.errors import ApiError, ProviderError, UpstreamMalformed, register_secret
from chatstream.upstreams.outcomes import TIMED_OUT, OutcomeKind, classify

from .upstream_helpers import outcome_of, status_error

# --- classifying the SDK's exceptions ---------------------------------------------------------


def _request():
    return httpx2.Request("POST", "http://up.test/v1/chat/completions")


def _connection_error(cause: BaseException, timeout: bool = False) -> openai.APIConnectionError:
    exc = openai.APITimeoutError(request=_request()) if timeout else openai.APIConnectionError(request=_request())
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(
    "exc, kind, failover",
    [
        (status_error(429, {"retry-after": "5"}), OutcomeKind.RATE_LIMITED, True),
        (status_error(500), OutcomeKind.SERVER_ERROR, True),
        (status_error(502), OutcomeKind.SERVER_ERROR, True),
        (status_error(503), OutcomeKind.SERVER_ERROR, True),
        (status_error(408), OutcomeKind.SERVER_ERROR, True),
        (status_error(409), OutcomeKind.SERVER_ERROR, True),
        (status_error(400), OutcomeKind.CLIENT_ERROR, False),
        (status_error(401), OutcomeKind.AUTH_ERROR, False),
        (status_error(403), OutcomeKind.AUTH_ERROR, False),
        (status_error(404), OutcomeKind.CLIENT_ERROR, False),
        (status_error(422), OutcomeKind.CLIENT_ERROR, False),
        (_connection_error(httpx2.ConnectError("refused")), OutcomeKind.CONNECT_FAILED, True),
        (_connection_error(ConnectionRefusedError()), OutcomeKind.CONNECT_FAILED, True),
        (_connection_error(httpx2.ConnectTimeout("slow"), timeout=True), OutcomeKind.CONNECT_FAILED, True),
        (_connection_error(httpx2.ReadError("reset")), OutcomeKind.CONNECTION_LOST, True),
        (_connection_error(httpx2.ReadTimeout("slow"), timeout=True), OutcomeKind.TIMEOUT, True),
        (TimeoutError(), OutcomeKind.TIMEOUT, True),  # the relay's first-token limit
        (openai.APIError("overloaded", _request(), body=None), OutcomeKind.SERVER_ERROR, True),
        (ValueError("a bug of ours"), OutcomeKind.OTHER, False),
        (RuntimeError("a bug of ours"), OutcomeKind.OTHER, False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_classify_sdk_exceptions(exc, kind, failover):
    outcome = outcome_of(exc)
    assert outcome.kind is kind
    assert outcome.failover is failover


def test_classify_reads_the_429_headers_of_the_response_and_extra_ones():
    assert outcome_of(status_error(429, {"retry-after-ms": "2500"})).cooldown == 2.5
    assert outcome_of(status_error(429, {"x-ratelimit-reset-tokens": "9"})).cooldown == 9
    assert outcome_of(status_error(429)).cooldown is None
    assert TIMED_OUT.failover


def test_an_error_event_in_the_stream_is_the_entrys_failure_for_every_api():
    """Chat completions' error event arrives as openai.APIError; the Responses API's `error` event as
    UpstreamReported: both move the request on and count against the entry (review finding: the
    Responses one was OTHER, so it neither failed over nor counted)."""
    from chatstream.errors import UpstreamReported

    for exc in (UpstreamReported("overloaded"), openai.APIError("overloaded", _request(), body=None)):
        outcome = outcome_of(exc)
        assert outcome.kind is OutcomeKind.SERVER_ERROR and outcome.failover


# --- what the caller is told --------------------------------------------------------------------

REQUEST = httpx2.Request("POST", "http://upstream.test/v1/chat/completions")


def told(exc: BaseException, model: str = "m", midstream: bool = False) -> ApiError:
    return classify(exc, model, midstream=midstream).error


def test_our_own_errors_pass_through():
    error = UpstreamMalformed()
    assert told(error) is error


def test_no_entra_token():
    error = told(ClientAuthenticationError("no credential"))
    assert (error.status, error.type, error.retryable) == (503, "upstream_auth_unavailable", True)


def test_timeout():
    error = told(openai.APITimeoutError(REQUEST))
    assert (error.status, error.type, error.retryable) == (504, "upstream_timeout", True)


def test_no_connection_a_connection_cut_before_output_and_after():
    refused = openai.APIConnectionError(request=REQUEST)
    refused.__cause__ = httpx2.ConnectError("refused")
    never = told(refused)
    assert (never.status, never.type, never.retryable) == (503, "upstream_unavailable", True)
    assert never.message == "could not reach the model server"
    cut = openai.APIConnectionError(request=REQUEST)
    cut.__cause__ = httpx2.ReadError("reset")
    before, after = told(cut), told(cut, midstream=True)
    # It reached the model server, which cut the stream: not "could not reach" (a 200 that then died).
    assert (before.status, before.type, before.retryable) == (502, "upstream_disconnected", True)
    assert "cut" in before.message
    assert (after.status, after.type, after.retryable) == (502, "upstream_disconnected", True)
    assert classify(cut).outcome.failover  # before any output, the request still moves on


@pytest.mark.parametrize("cls, status", [(openai.AuthenticationError, 401), (openai.PermissionDeniedError, 403)])
def test_our_credentials_refused_never_quote_the_upstream(cls, status):
    exc = status_error(status, body={"error": {"message": "Incorrect API key provided: sk-abc***xyz"}})
    error = told(exc)
    assert (error.status, error.type, error.retryable) == (502, "upstream_auth", False)
    assert "sk-" not in error.message


def test_unknown_model():
    error = told(status_error(404), "gpt-x")
    assert (error.status, error.type, error.param) == (400, "model_not_found", "model")
    assert "'gpt-x'" in error.message


def test_rate_limited_keeps_message_and_retry_after():
    exc = status_error(429, {"retry-after": "12"}, body={"error": {"message": "slow down"}})
    error = told(exc)
    assert (error.status, error.type, error.message, error.retryable) == (429, "rate_limited", "slow down", True)
    assert error.headers == {"Retry-After": "12"}


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "1e308", "99999999999", "garbage", "0"])
def test_a_caller_only_ever_gets_a_valid_retry_after(value):
    headers = told(status_error(429, {"retry-after": value})).headers
    if "Retry-After" in headers:
        assert headers["Retry-After"].isdigit() and 1 <= int(headers["Retry-After"]) <= 3600


def test_bad_request_keeps_message_and_param():
    exc = status_error(400, body={"error": {"message": "temperature too high", "param": "temperature"}})
    error = told(exc)
    assert (error.status, error.type, error.message, error.param) == (
        400,
        "invalid_request",
        "temperature too high",
        "temperature",
    )


@pytest.mark.parametrize(
    "status, body, provider",
    [
        (
            400,
            {
                "error": {
                    "message": "too long",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            ProviderError("context_length_exceeded", "invalid_request_error", "messages"),
        ),
        (
            400,
            {"error": {"message": "filtered", "code": "content_filter", "param": "prompt", "status": 400}},
            ProviderError("content_filter", None, "prompt"),
        ),
        (
            400,
            {"object": "error", "message": "vLLM", "type": "BadRequestError", "code": 400},
            ProviderError(None, "BadRequestError", None),
        ),  # vLLM: a numeric code is its status
        (
            429,
            {"error": {"message": "slow", "type": "requests", "code": "rate_limit_exceeded"}},
            ProviderError("rate_limit_exceeded", "requests", None),
        ),
        (
            500,
            {"error": {"message": "boom", "type": "server_error", "code": None}},
            ProviderError(None, "server_error"),
        ),
        (401, {"error": {"message": "bad key", "type": "invalid_request_error", "code": "invalid_api_key"}}, None),
        (400, "not json", None),
    ],
)
def test_the_upstreams_code_type_and_param_are_kept_apart_from_ours(status, body, provider):
    error = told(status_error(status, body=body))
    assert error.provider == provider, "401/403 are about our key: never the upstream's code"
    if provider is not None and provider.param is not None:
        assert error.param == provider.param


def test_an_error_event_keeps_the_upstreams_code():
    event = {"message": "boom", "type": "server_error", "code": "server_is_overloaded", "param": None}
    error = told(openai.APIError("boom", REQUEST, body=event))
    assert error.provider == ProviderError("server_is_overloaded", "server_error", None)
    assert error.body()["error"]["code"] == "server_is_overloaded" and error.body()["error"]["type"] == "upstream_error"


def test_unprocessable_is_a_bad_request_and_a_body_without_error_wrapper_is_read():
    error = told(status_error(422, body={"message": "bad field", "param": 5}))
    assert (error.status, error.type, error.message, error.param) == (400, "invalid_request", "bad field", None)


def test_bad_request_without_a_body_uses_the_sdk_message():
    error = told(status_error(400, body="not json"))
    assert error.message == "upstream said no" and error.param is None


@pytest.mark.parametrize("status, retryable", [(500, True), (503, True), (408, True), (409, True), (418, False)])
def test_other_statuses(status, retryable):
    error = told(status_error(status, body={"error": {"message": "secret detail"}}))
    assert (error.status, error.type, error.retryable) == (502, "upstream_error", retryable)
    assert error.message == f"the model server failed (HTTP {status})"


def test_an_error_event_inside_the_stream():
    error = told(openai.APIError("overloaded", REQUEST, body=None))
    assert (error.status, error.type, error.retryable) == (502, "upstream_error", True)
    assert error.message == "the model server reported an error: overloaded"


def test_anything_else_is_a_bug_of_ours_and_not_the_entrys():
    found = classify(ValueError("x"))
    assert (found.error.status, found.error.type) == (500, "internal_error")
    assert found.outcome.kind is OutcomeKind.OTHER and not found.outcome.failover


def test_the_first_token_limit_of_one_entry():
    assert classify(TimeoutError()).outcome is TIMED_OUT and classify(TimeoutError()).error.status == 504


@pytest.mark.parametrize("status", [400, 404, 429])
def test_an_upstream_quoting_our_key_never_passes_it_on(status):
    key = "sk-outcome-SECRET-9f8e7d6c5b4a"
    register_secret(key)
    exc = status_error(status, body={"error": {"message": f"Invalid header Authorization: Bearer {key}"}})
    error = told(exc)
    assert key not in error.message and key not in str(error.body())
