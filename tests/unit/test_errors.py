"""chatstream/errors.py: the one error hierarchy, the Retry-After parser, redaction."""

from __future__ import annotations

import email.utils
import json
import time

import httpx2
import pytest

from chatstream.errors import (
    ApiError,
    ErrorKind,
    ModerationStop,
    ProviderError,
    Rejection,
    StepFailed,
    TimeLimit,
    UpstreamMalformed,
    as_status,
    instance_draining,
    internal_error,
    invalid_request,
    parse_retry_after,
    provider_error,
    redact,
    register_secret,
    retry_after_headers,
)
from chatstream.http import error_headers

# ------------------------------------------------------------------------------------ the shapes


def test_body_without_param():
    error = ApiError(502, "upstream_error", "it failed", retryable=True)
    assert error.body() == {"error": {"type": "upstream_error", "message": "it failed", "retryable": True}}
    assert error.headers == {} and str(error) == "it failed"


def test_body_with_param_keeps_the_order():
    body = invalid_request("bad", "messages[0].role").body()
    assert list(body["error"]) == ["type", "message", "param", "retryable"]
    assert body == {
        "error": {"type": "invalid_request", "message": "bad", "param": "messages[0].role", "retryable": False}
    }


def test_repr_names_status_and_type():
    assert repr(ApiError(400, "x", "m")) == "ApiError(400, 'x', 'm')"
    assert repr(TimeLimit("total_timeout", "t")) == "TimeLimit(504, 'total_timeout', 't')"


def test_rejection():
    error = Rejection(422, "refused by policy")
    assert (error.status, error.type, error.message, error.param, error.retryable) == (
        422,
        "rejected",
        "refused by policy",
        None,
        False,
    )
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


@pytest.mark.parametrize("kind", list(ErrorKind))
@pytest.mark.parametrize("retryable", [True, False])
def test_every_error_status_says_one_thing_in_x_should_retry_and_in_retryable(kind, retryable):
    """Whatever the kind, a status's header and its body agree; an upstream failure the app has
    retried already tells the caller not to send it again at once (its SDK would repeat the retries)."""
    from chatstream.apis.chat import ChatApi
    from chatstream.apis.openai_chat import error_response

    told = as_status(ApiError(503, kind, "m", retryable=retryable, headers={"Retry-After": "3"}))
    chat = ChatApi().error_response(told)
    said = json.loads(bytes(chat.body))["error"]["retryable"]
    for response in (chat, error_response(told)):
        assert response.headers["x-should-retry"] == ("true" if said else "false")
        assert response.headers["retry-after"] == "3"
    upstream = kind.startswith("upstream_") or kind in ("rate_limited", "internal_error")
    assert said is (retryable and not upstream)


def test_the_retryable_statuses_of_our_own():
    assert error_headers(as_status(instance_draining()))["x-should-retry"] == "true"
    assert error_headers(as_status(internal_error()))["x-should-retry"] == "false"
    assert as_status(internal_error()).retryable is False and internal_error().retryable  # a copy: the event keeps it
    assert error_headers(as_status(TimeLimit("upstream_timeout", "slow")))["x-should-retry"] == "false"


def test_every_error_is_an_api_error():
    for error in (Rejection(400, "m"), StepFailed("s"), ModerationStop("r"), TimeLimit("t", "m"), UpstreamMalformed()):
        assert isinstance(error, ApiError)


# ------------------------------------------------------------------------------- retry-after


def caller_headers(headers: dict) -> dict:
    """What a caller is told, from an upstream's headers (as outcomes.classify does)."""
    lower = {k.lower() for k in headers}
    return retry_after_headers(parse_retry_after(headers), ms="retry-after-ms" in lower)


def test_retry_after():
    assert caller_headers(httpx2.Headers({"retry-after": "7"})) == {"Retry-After": "7"}
    # retry-after-ms: whole seconds rounded up (never 0), and the milliseconds passed on
    assert caller_headers({"retry-after-ms": "2400"}) == {"Retry-After": "3", "retry-after-ms": "2400"}
    assert caller_headers({"retry-after-ms": "10"}) == {"Retry-After": "1", "retry-after-ms": "10"}
    assert caller_headers({"retry-after-ms": "1e400"}) == {}  # infinite: no header, no crash
    assert caller_headers({"retry-after-ms": "soon"}) == {}
    assert caller_headers({}) == {}
    # both: the longer wait (coming back at the shorter one would meet the limit again)
    assert caller_headers({"retry-after": "3", "retry-after-ms": "9000"}) == {
        "Retry-After": "9",
        "retry-after-ms": "9000",
    }


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "-inf", "garbage", "é", "", "1e308e", "0x10"])
def test_garbage_retry_after_is_nothing(value):
    assert caller_headers({"Retry-After": value}) == {}


@pytest.mark.parametrize(
    "value, expected", [("1e308", "3600"), ("99999999999", "3600"), ("0", "1"), ("0.2", "1"), ("59.1", "60")]
)
def test_retry_after_is_whole_seconds_within_bounds(value, expected):
    assert caller_headers({"Retry-After": value}) == {"Retry-After": expected}


def test_retry_after_as_an_http_date_past_and_future():
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= int(caller_headers({"Retry-After": future})["Retry-After"]) <= 31
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert parse_retry_after({"Retry-After": past}) == 0.0
    assert caller_headers({"Retry-After": "Wed, 21 Oct 2015 07:28:00"}) == {}  # no zone: not a valid date


def test_error_kinds_are_their_strings():
    error = ApiError(429, "rate_limited", "m")
    assert error.type is ErrorKind.RATE_LIMITED and error.type == "rate_limited"
    assert json.dumps(error.body()) == '{"error": {"type": "rate_limited", "message": "m", "retryable": false}}'
    assert Rejection(403, "no", "my_own_type").type == "my_own_type"  # a before-step's own type stays


def test_redact_removes_every_registered_secret():
    register_secret("sk-unit-SECRET-1234567890")
    register_secret("short")  # too short to redact safely: ignored
    assert redact("Bearer sk-unit-SECRET-1234567890 was refused") == "Bearer [redacted] was refused"
    assert redact("short words stay") == "short words stay"


def test_the_provider_error_is_read_from_the_error_object_itself():
    """The code, type and param of ``{"error": {...}}`` or of the object itself; a field of that
    object named ``error`` is one of its own, not a further level to read them from."""
    inner = {"message": "m", "code": "model_not_found", "type": "invalid_request_error", "param": "model"}
    for body in ({"error": inner}, inner, {"error": {**inner, "error": "NotFoundError"}}):
        assert provider_error(body) == ProviderError("model_not_found", "invalid_request_error", "model"), body
    assert provider_error({"error": {"message": "m", "code": 404}}) == ProviderError(None, None, None)
    assert provider_error({"error": "m"}) is None and provider_error("m") is None
