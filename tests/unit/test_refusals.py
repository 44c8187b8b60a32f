"""chatstream/apis/refusals.py: the shared state's answers as a caller sees them: OpenAI's statuses,
codes and wording, Retry-After, x-should-retry and the x-ratelimit-* headers."""

from __future__ import annotations

import json

import pytest

from chatstream.apis.chat import ChatApi
from chatstream.apis.openai_chat import error_response
from chatstream.apis.refusals import caller_key, duration, error, rate_headers
from chatstream.errors import as_status
from chatstream.http import error_headers
from chatstream.state.port import KeyRefused, LimitRef, ModelRefused, Rate, Refused, Unavailable, Unknown


def test_a_minute_limit_is_a_retryable_429_with_the_seconds_to_the_next_minute():
    refused = Refused(LimitRef("caller", "app", "tokens_per_minute"), 500, 480, 100, retry_after=42.7)
    answer = error(refused)
    assert (answer.status, answer.type) == (429, "rate_limit_exceeded")
    assert answer.retryable and error_headers(answer) == {
        "Retry-After": "43",
        "Cache-Control": "no-store",
        "x-should-retry": "true",
    }
    assert "caller 'app'" in answer.message and "Limit 500, Used 480, Requested 100" in answer.message
    assert "try again in 43s" in answer.message
    per_model = error(Refused(LimitRef("team", "t", "requests_per_minute", "gpt-4o"), 2, 2, 1, retry_after=0.2))
    assert "team 't' for model 'gpt-4o'" in per_model.message and per_model.headers["Retry-After"] == "1"


def test_a_request_larger_than_a_limit_is_not_to_be_retried():
    alone = error(Refused(LimitRef("caller", "app", "tokens_per_minute"), 1_000, 0, 1_001, 30.0, alone=True))
    assert (alone.status, alone.type) == (429, "rate_limit_exceeded")
    assert not alone.retryable and error_headers(alone)["x-should-retry"] == "false"
    assert "Retry-After" not in alone.headers and "Lower max_tokens" in alone.message
    budget = error(Refused(LimitRef("caller", "app", "token_budget", period="month"), 5_000, 0, 5_001, alone=True))
    assert (budget.status, budget.type) == (429, "insufficient_quota") and not budget.retryable
    assert "lower max_tokens" in budget.message and "this month (UTC)" in budget.message


def test_a_spent_budget_is_insufficient_quota_saying_what_is_left():
    tokens_ = error(Refused(LimitRef("caller", "app", "token_budget", period="total"), 1000, 770, 231))
    assert (tokens_.status, tokens_.type) == (429, "insufficient_quota")
    assert "230 of its 1000 budget tokens left in total" in tokens_.message
    money = error(
        Refused(LimitRef("team", "search", "spend_budget", period="day"), 25 * 10**12, 24_990_000 * 10**6, 20 * 10**9)
    )
    assert money.type == "insufficient_quota" and not money.retryable and "Retry-After" not in money.headers
    assert "Team 'search' has $0.01 of its $25.00 spend budget left today (UTC)" in money.message
    assert "may cost up to $0.02" in money.message


@pytest.mark.parametrize(
    ("answer", "status", "code", "param"),
    [
        (KeyRefused(), 401, "invalid_api_key", None),
        (KeyRefused(expired=True), 401, "invalid_api_key", None),
        (Unavailable(), 503, "caller_store_unavailable", None),
        (ModelRefused("o1"), 404, "model_not_found", "model"),
        (ModelRefused("local", unpriced=True, scope="team"), 400, "model_not_priced", "model"),
        (ModelRefused("m", unreadable=True), 503, "not_configured", "model"),
        (Unknown("response", "resp_1"), 404, "not_found", "previous_response_id"),
    ],
)
def test_the_other_refusals(answer, status, code, param):
    found = error(answer)
    assert (found.status, found.type, found.param) == (status, code, param)
    if isinstance(answer, KeyRefused) and answer.expired:
        assert "expired" in found.message
    if isinstance(answer, Unavailable):
        assert found.retryable and found.headers["Retry-After"] == "2"
    if isinstance(answer, ModelRefused) and answer.unpriced:
        assert "'local' has no price" in found.message and "team" in found.message
    if isinstance(answer, ModelRefused) and answer.unreadable:
        assert "price of the model 'm'" in found.message and "unreadable" in found.message


@pytest.mark.parametrize(
    ("answer", "retry"),
    [
        (KeyRefused(), False),
        (KeyRefused(expired=True), False),
        (Unavailable(), True),  # nothing was started: another try, or another instance, may find the store
        (ModelRefused("o1"), False),
        (ModelRefused("local", unpriced=True, scope="team"), False),
        (ModelRefused("m", unreadable=True), False),  # not until an admin sets the price again
        (Unknown("response", "resp_1"), False),
        (Refused(LimitRef("caller", "app", "tokens_per_minute"), 500, 480, 100, retry_after=42.7), True),
        (Refused(LimitRef("team", "t", "requests_per_minute", "gpt-4o"), 2, 2, 1, retry_after=0.2), True),
        (Refused(LimitRef("caller", "app", "tokens_per_minute"), 1_000, 0, 1_001, 30.0, alone=True), False),
        (Refused(LimitRef("caller", "app", "token_budget", period="month"), 5_000, 4_000, 2_000), False),
        (Refused(LimitRef("team", "t", "spend_budget", period="day"), 10**12, 0, 2 * 10**12, alone=True), False),
    ],
)
def test_every_refusal_says_one_thing_in_its_header_and_its_body(answer, retry):
    """The probe: 503 caller_store_unavailable said x-should-retry: false with retryable: true."""
    told = as_status(error(answer))
    chat = ChatApi().error_response(told)  # /api/chat: {"error": {..., "retryable"}}
    assert json.loads(bytes(chat.body))["error"]["retryable"] is retry
    for response in (chat, error_response(told)):  # and OpenAI's shape, whose SDKs read the header
        assert response.headers["x-should-retry"] == ("true" if retry else "false")
        assert response.headers["cache-control"] == "no-store"


def test_a_name_from_a_caller_is_made_safe_for_the_message():
    found = error(ModelRefused("a\nb\u2028" + "x" * 500))
    assert "\n" not in found.message and "\u2028" not in found.message and len(found.message) < 300


def test_the_ratelimit_headers_are_openais():
    headers = rate_headers({"tokens": Rate(50_000, 41_000, 42.7), "requests": Rate(10, 9, 0.25)})
    assert headers == {
        "x-ratelimit-limit-tokens": "50000",
        "x-ratelimit-remaining-tokens": "41000",
        "x-ratelimit-reset-tokens": "42.7s",
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "250ms",
    }
    assert [duration(s) for s in (0.0, 0.9994, 1.0, 17.5, 63.0, 125.25)] == [
        "0ms",
        "999ms",
        "1s",
        "17.5s",
        "1m3s",
        "2m5.25s",
    ]


def test_the_key_is_read_from_openai_or_azure_headers():
    assert caller_key({"authorization": "Bearer csk-abc"}) == "csk-abc"
    assert caller_key({"authorization": "bearer  csk-abc "}) == "csk-abc"
    assert caller_key({"api-key": "csk-abc"}) == "csk-abc"
    assert caller_key({"authorization": "Basic xyz"}) is None
    assert caller_key({"authorization": "Bearer "}) is None
    assert caller_key({}) is None
