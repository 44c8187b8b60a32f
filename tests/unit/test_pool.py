"""chatstream/pool.py in-process: UPSTREAMS validation, the order entries are tried in, 429
cooldowns, the breaker, and classifying the openai SDK's exceptions. A fake clock drives time."""
from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import random

import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.pool import (
    Entry, Outcome, OutcomeKind, Policy, Pool, PoolConfigError, classify, cooldown_from_headers,
    legacy_entry, parse_upstreams,
)

SECRET = "sk-pool-SECRET-7d1e0b9c3aQZ"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def entry(name: str, priority: int = 1, weight: float = 1.0, models=None, **kw) -> Entry:
    return Entry(name=name, kind=kw.pop("kind", "openai"), url=kw.pop("url", f"http://{name}.test/v1"),
                 priority=priority, weight=weight, models=tuple(models) if models else None, **kw)


def make_pool(*entries: Entry, seed: int = 7, **policy) -> tuple[Pool, Clock]:
    clock = Clock()
    return Pool(entries, policy=Policy(**policy), now=clock, rng=random.Random(seed)), clock


def names(entries) -> list[str]:
    return [e.name for e in entries]


def attempt(pool: Pool, name: str, model: str = "gpt-4o", outcome: Outcome | None = None):
    a = pool.acquire(pool.entry(name), model)
    assert a is not None, f"{name} is not free"
    if outcome is not None:
        a.report(outcome)
    return a


def status_error(status: int, headers: dict | None = None, body: object = None) -> openai.APIStatusError:
    request = httpx2.Request("POST", "http://up.test/v1/chat/completions")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    cls = {429: openai.RateLimitError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
           404: openai.NotFoundError, 400: openai.BadRequestError, 422: openai.UnprocessableEntityError,
           409: openai.ConflictError}.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return cls("upstream said no", response=response, body=body)


SERVER_ERROR = Outcome.from_status(500)
CONNECT_FAILED = Outcome(OutcomeKind.CONNECT_FAILED)


# --- order ------------------------------------------------------------------------------------

def test_candidates_are_ordered_by_priority_lowest_first():
    pool, _ = make_pool(entry("openai", 3), entry("paygo-a", 2), entry("ptu", 1), entry("paygo-b", 2))
    for _ in range(20):
        order = names(pool.candidates("gpt-4o"))
        assert order[0] == "ptu" and order[-1] == "openai"
        assert set(order[1:3]) == {"paygo-a", "paygo-b"}


def test_weights_share_first_place_within_a_priority():
    pool, _ = make_pool(entry("a", weight=3), entry("b", weight=1), entry("c", weight=1), entry("z", priority=2))
    draws = 5000
    first = collections.Counter(pool.candidates("m")[0].name for _ in range(draws))
    assert first["z"] == 0
    for name, share in (("a", 0.6), ("b", 0.2), ("c", 0.2)):
        assert abs(first[name] / draws - share) < 0.03, first


def test_weighted_order_is_sampling_without_replacement():
    # With weights 3:1:1, "b" is second after "a" first with probability 1/2 and first with 1/5.
    pool, _ = make_pool(entry("a", weight=3), entry("b", weight=1), entry("c", weight=1), seed=11)
    draws = 5000
    orders = collections.Counter(tuple(names(pool.candidates("m"))) for _ in range(draws))
    assert all(len(set(order)) == 3 for order in orders)
    assert abs(orders[("a", "b", "c")] / draws - 0.3) < 0.03, orders   # 3/5 · 1/2


def test_models_route_to_the_entries_that_serve_them_with_the_deployment_mapping():
    ptu = entry("ptu", kind="azure", models=["gpt-4o"], deployments={"gpt-4o": "gpt4o-ptu"}, api_version="2024-10-21")
    mini = entry("mini", models=["gpt-4o-mini"])
    anything = entry("local", priority=5)
    pool, _ = make_pool(ptu, mini, anything)
    assert names(pool.candidates("gpt-4o")) == ["ptu", "local"]
    assert names(pool.candidates("gpt-4o-mini")) == ["mini", "local"]
    assert names(pool.candidates("llama3")) == ["local"]
    assert ptu.deployment("gpt-4o") == "gpt4o-ptu" and anything.deployment("gpt-4o") == "gpt-4o"
    pool_without_catch_all, _ = make_pool(ptu, mini)
    assert pool_without_catch_all.candidates("llama3") == []
    assert not pool_without_catch_all.serves("llama3")
    assert pool_without_catch_all.retry_after("llama3") is None  # not served: a 400, not a 429


# --- 429 cooldowns ----------------------------------------------------------------------------

def test_a_429_with_retry_after_takes_the_entry_out_for_that_long_then_back():
    pool, clock = make_pool(entry("ptu", 1), entry("paygo", 2))
    attempt(pool, "ptu", outcome=classify(status_error(429, {"retry-after": "30"})))
    assert names(pool.candidates("gpt-4o")) == ["paygo"]
    clock.advance(29.9)
    assert names(pool.candidates("gpt-4o")) == ["paygo"]
    clock.advance(0.1)
    assert names(pool.candidates("gpt-4o")) == ["ptu", "paygo"]


def test_a_cooldown_is_per_deployment_not_per_entry():
    pool, _ = make_pool(entry("azure"), entry("other", 2))
    attempt(pool, "azure", "gpt-4o", Outcome.rate_limited({"retry-after": "30"}))
    assert names(pool.candidates("gpt-4o")) == ["other"]
    assert names(pool.candidates("gpt-4o-mini")) == ["azure", "other"]


@pytest.mark.parametrize("headers, expected", [
    ({"retry-after": "30"}, 30),
    ({"Retry-After": "2.5"}, 2.5),
    ({"retry-after-ms": "1500"}, 1.5),
    ({"retry-after-ms": "1500", "retry-after": "2"}, 2),  # the largest
    ({"x-ratelimit-reset-requests": "7"}, 7),                          # Azure: seconds
    ({"x-ratelimit-reset-tokens": "12.5", "x-ratelimit-reset-requests": "1"}, 12.5),
    ({"x-ratelimit-reset-tokens": "6m0s"}, 360),                        # OpenAI: a duration
    ({"x-ratelimit-reset-requests": "1m30.5s"}, 90.5),
    ({"x-ratelimit-reset-requests": "20ms", "retry-after-ms": "10"}, 0.02),
    ({"x-ratelimit-reset-tokens": "0", "x-ratelimit-reset-requests": "-1"}, None),  # Azure's placeholders
    ({"retry-after": "soon"}, None),
    ({"retry-after": "nan"}, None),
    ({"retry-after": "0"}, 0),
    ({}, None),
])
def test_cooldown_from_headers(headers, expected):
    assert cooldown_from_headers(headers, wall_now=0) == expected


def test_retry_after_as_an_http_date():
    wall = 1_700_000_000.0
    date = email.utils.formatdate(wall + 45, usegmt=True)
    assert cooldown_from_headers({"Retry-After": date}, wall_now=wall) == pytest.approx(45)
    past = email.utils.formatdate(wall - 45, usegmt=True)
    assert cooldown_from_headers({"Retry-After": past}, wall_now=wall) == 0


@pytest.mark.parametrize("headers, seconds", [
    ({"retry-after-ms": "4000"}, 4),
    ({"x-ratelimit-reset-tokens": "20"}, 20),
    ({}, 10),                               # no header: the default
    ({"retry-after": "0"}, 1),              # the shortest cooldown
    ({"retry-after": "86400"}, 300),        # capped (Azure asks for a day when a quota is spent)
])
def test_the_pool_applies_cooldowns_with_a_default_a_floor_and_a_cap(headers, seconds):
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=Outcome.rate_limited(headers, wall_now=0))
    assert pool.retry_after("gpt-4o") == pytest.approx(seconds)
    clock.advance(seconds - 0.01)
    assert pool.candidates("gpt-4o") == []
    clock.advance(0.01)
    assert names(pool.candidates("gpt-4o")) == ["a"]


def test_when_every_entry_is_cooling_down_retry_after_is_the_soonest():
    pool, clock = make_pool(entry("a"), entry("b"), entry("c", 2))
    assert pool.retry_after("gpt-4o") is None
    attempt(pool, "a", outcome=Outcome.rate_limited({"retry-after": "30"}))
    attempt(pool, "b", outcome=Outcome.rate_limited({"retry-after": "12"}))
    assert pool.retry_after("gpt-4o") is None  # c is still free
    attempt(pool, "c", outcome=Outcome.rate_limited({"retry-after": "20"}))
    assert pool.candidates("gpt-4o") == []
    assert pool.retry_after("gpt-4o") == pytest.approx(12)
    assert pool.unavailable("gpt-4o").reason == "rate_limited"
    clock.advance(5)
    assert pool.retry_after("gpt-4o") == pytest.approx(7)
    clock.advance(7)
    assert pool.retry_after("gpt-4o") is None
    assert names(pool.candidates("gpt-4o")) == ["b"]


def test_an_insufficient_quota_429_cools_down_for_the_maximum_and_is_a_config_problem():
    events = []
    clock = Clock()
    pool = Pool([entry("openai")], now=clock, on_event=events.append)
    outcome = classify(status_error(429, {"retry-after": "1"}, body={"code": "insufficient_quota"}))
    assert outcome.kind is OutcomeKind.QUOTA_EXHAUSTED and outcome.failover and outcome.config_problem
    attempt(pool, "openai", outcome=outcome)
    assert pool.retry_after("gpt-4o") == pytest.approx(300)
    assert [e.event for e in events] == ["config_problem", "cooldown"]


# --- the breaker ------------------------------------------------------------------------------

def test_three_consecutive_server_errors_open_the_breaker_and_a_success_resets_the_count():
    pool, _ = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=SERVER_ERROR)
    attempt(pool, "a", outcome=SERVER_ERROR)
    attempt(pool, "a", outcome=Outcome.success())
    attempt(pool, "a", outcome=SERVER_ERROR)
    attempt(pool, "a", outcome=SERVER_ERROR)
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    attempt(pool, "a", outcome=SERVER_ERROR)
    assert names(pool.candidates("gpt-4o")) == ["b"]
    assert pool.state()[0]["state"] == "open"


def test_failures_far_apart_do_not_add_up():
    pool, clock = make_pool(entry("a"))
    for _ in range(5):
        attempt(pool, "a", outcome=SERVER_ERROR)
        attempt(pool, "a", outcome=SERVER_ERROR)
        clock.advance(61)
    assert pool.state()[0]["state"] == "ok"


def test_a_failure_to_connect_opens_the_breaker_at_once():
    pool, _ = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    assert names(pool.candidates("gpt-4o")) == ["b"]
    assert pool.unavailable("gpt-4o") is None


def test_the_back_off_grows_then_a_half_open_probe_closes_the_breaker():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    for backoff in (5, 10, 20, 40, 80, 160, 300, 300):
        attempt(pool, "a", outcome=CONNECT_FAILED)  # opens (from closed), or the probe fails: reopens
        assert pool.state()[0]["state"] == "open"
        assert pool.state()[0]["until"] == pytest.approx(backoff)
        clock.advance(backoff - 0.01)
        assert names(pool.candidates("gpt-4o")) == ["b"]
        clock.advance(0.01)
        assert pool.state()[0]["state"] == "half_open"
        assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    probe = attempt(pool, "a")
    assert probe.probe
    probe.report(Outcome.success())
    assert pool.state()[0]["state"] == "ok"
    # Closed again: the next opening starts from the first back-off.
    attempt(pool, "a", outcome=CONNECT_FAILED)
    assert pool.state()[0]["until"] == pytest.approx(5)


def test_only_one_probe_at_a_time():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    first, second = pool.candidates("gpt-4o"), pool.candidates("gpt-4o")
    assert names(first) == names(second) == ["a", "b"]  # both requests see it free…
    probe = pool.acquire(first[0], "gpt-4o")
    assert probe is not None and probe.probe
    assert pool.acquire(second[0], "gpt-4o") is None     # …only one gets the probe
    assert names(pool.candidates("gpt-4o")) == ["b"]
    state = pool.state()[0]
    assert state["state"] == "half_open" and state["probing"]
    probe.report(Outcome.success())
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    assert pool.acquire(pool.entry("a"), "gpt-4o").probe is False


def test_when_the_only_entry_is_being_probed_retry_after_is_short():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    assert pool.unavailable("gpt-4o").reason == "unavailable"
    assert pool.retry_after("gpt-4o") == pytest.approx(5)
    clock.advance(5)
    probe = attempt(pool, "a")
    assert pool.retry_after("gpt-4o") == pytest.approx(1)
    probe.report(SERVER_ERROR)  # the probe failed: reopened, longer
    assert pool.retry_after("gpt-4o") == pytest.approx(10)


def test_a_cancelled_probe_frees_its_slot_and_the_entry_stays_half_open():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    with pytest.raises(KeyboardInterrupt):  # any BaseException, as asyncio.CancelledError is
        with pool.acquire(pool.entry("a"), "gpt-4o") as probe:
            assert probe.probe
            raise KeyboardInterrupt
    assert pool.state()[0]["state"] == "half_open" and not pool.state()[0]["probing"]
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    again = pool.acquire(pool.entry("a"), "gpt-4o")
    assert again.probe
    again.release()
    again.release()  # idempotent
    assert pool.acquire(pool.entry("a"), "gpt-4o").probe


def test_a_probe_slot_is_released_when_the_task_is_cancelled():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)

    async def main():
        started = asyncio.Event()

        async def request():
            with pool.acquire(pool.entry("a"), "gpt-4o"):
                started.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(request())
        await started.wait()
        assert pool.candidates("gpt-4o") == []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert names(pool.candidates("gpt-4o")) == ["a"]


def test_a_probe_answered_with_a_429_closes_the_breaker_and_cools_the_deployment():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    attempt(pool, "a", outcome=Outcome.rate_limited({"retry-after": "3"}))
    state = pool.state()[0]
    assert state["state"] == "cooling_down" and state["cooldowns"] == {"gpt-4o": 3}
    clock.advance(3)
    assert pool.state()[0]["state"] == "ok"


def test_attempts_started_before_the_breaker_opened_do_not_move_it():
    pool, clock = make_pool(entry("a"))
    slow = [attempt(pool, "a") for _ in range(3)]
    attempt(pool, "a", outcome=CONNECT_FAILED)               # opens
    slow[0].report(Outcome.success())                        # stale: stays open
    assert pool.state()[0]["state"] == "open"
    clock.advance(5)
    probe = attempt(pool, "a")
    slow[1].report(SERVER_ERROR)                             # stale: does not reopen, keeps the probe
    assert pool.state()[0]["probing"]
    probe.report(Outcome.success())
    slow[2].report(SERVER_ERROR)                             # stale (previous era): no count
    assert pool.state()[0]["consecutive_failures"] == 0


def test_client_errors_and_auth_errors_do_not_touch_the_entrys_health():
    events = []
    clock = Clock()
    pool = Pool([entry("a")], now=clock, on_event=events.append)
    for status in (400, 401, 403, 404, 413, 422) * 3:
        attempt(pool, "a", outcome=classify(status_error(status)))
    state = pool.state()[0]
    assert state["state"] == "ok" and state["consecutive_failures"] == 0
    assert state["counters"]["failures"] == 0 and state["counters"]["failovers"] == 0
    assert [e.reason for e in events] == ["auth_error", "auth_error"] * 3


def test_a_mid_stream_failure_counts_against_the_entry_but_not_as_a_failover():
    pool, _ = make_pool(entry("a"))
    a = attempt(pool, "a")
    a.report(Outcome.success())                 # the first delta
    a.report(Outcome(OutcomeKind.CONNECTION_LOST))
    counters = pool.state()[0]["counters"]
    assert counters == {"requests": 1, "successes": 1, "failures": 1, "failovers": 0, "cooldowns": 0, "opens": 0}
    assert pool.state()[0]["consecutive_failures"] == 1


def test_state_reports_each_entry_without_any_key():
    ptu = Entry(name="ptu", kind="azure", url="https://ptu.openai.azure.com", api_version="2024-10-21",
                api_key=None, priority=1, models=("gpt-4o",), deployments={"gpt-4o": "gpt4o-ptu"})
    openai_entry = legacy_entry("openai", api_key=SECRET, base_url="https://user:pw@api.openai.com/v1")
    pool, clock = make_pool(ptu, openai_entry)
    attempt(pool, "ptu", outcome=Outcome.rate_limited({"retry-after": "30"}))
    attempt(pool, "default", outcome=SERVER_ERROR)
    clock.advance(10)
    state = pool.state()
    assert state[0] == {
        "name": "ptu", "kind": "azure", "url": "https://ptu.openai.azure.com", "auth": "entra", "key_setting": None,
        "priority": 1, "weight": 1.0, "models": ["gpt-4o"], "state": "cooling_down", "until": 20.0, "probing": False,
        "cooldowns": {"gpt4o-ptu": 20.0}, "consecutive_failures": 0,
        "counters": {"requests": 1, "successes": 0, "failures": 0, "failovers": 1, "cooldowns": 1, "opens": 0},
    }
    assert state[1]["auth"] == "key" and state[1]["consecutive_failures"] == 1
    assert state[1]["url"] == "https://api.openai.com/v1"
    text = json.dumps(state) + repr(pool.entries) + repr(openai_entry)
    assert SECRET not in text and "pw" not in text


# --- classifying the SDK's exceptions ---------------------------------------------------------

def _request():
    return httpx2.Request("POST", "http://up.test/v1/chat/completions")


def _connection_error(cause: BaseException, timeout: bool = False) -> openai.APIConnectionError:
    exc = openai.APITimeoutError(request=_request()) if timeout else openai.APIConnectionError(request=_request())
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize("exc, kind, failover", [
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
    (TimeoutError(), OutcomeKind.TIMEOUT, True),           # the relay's first-token limit
    (openai.APIError("overloaded", _request(), body=None), OutcomeKind.SERVER_ERROR, True),
    (ValueError("a bug of ours"), OutcomeKind.OTHER, False),
    (RuntimeError("a bug of ours"), OutcomeKind.OTHER, False),
], ids=lambda v: v if isinstance(v, str) else None)
def test_classify_sdk_exceptions(exc, kind, failover):
    outcome = classify(exc)
    assert outcome.kind is kind
    assert outcome.failover is failover


def test_classify_reads_the_429_headers_of_the_response_and_extra_ones():
    assert classify(status_error(429, {"retry-after-ms": "2500"})).cooldown == 2.5
    assert classify(status_error(429), {"x-ratelimit-reset-tokens": "9"}).cooldown == 9
    assert classify(status_error(429)).cooldown is None
    assert Outcome.first_token_timeout().failover


def test_401_and_403_are_flagged_as_configuration_problems():
    assert classify(status_error(401)).config_problem
    assert classify(status_error(403)).config_problem
    assert not classify(status_error(500)).config_problem


# --- UPSTREAMS --------------------------------------------------------------------------------

ENV = {"PAYGO_KEY": SECRET, "OPENAI_KEY": SECRET + "-openai"}


def test_a_valid_upstreams_value():
    raw = json.dumps([
        {"name": "ptu", "azure_endpoint": "https://ptu.openai.azure.com/", "priority": 1,
         "models": ["gpt-4o"], "deployments": {"gpt-4o": "gpt4o-ptu"}},
        {"name": "paygo-eastus", "azure_endpoint": "https://eastus.openai.azure.com", "api_version": "2025-01-01",
         "api_key_setting": "PAYGO_KEY", "priority": 2, "weight": 2},
        {"name": "openai", "base_url": "https://api.openai.com/v1", "api_key_setting": "OPENAI_KEY", "priority": 3,
         "weight": 0.5},
        {"name": "local", "base_url": "http://127.0.0.1:8000/v1", "priority": 4},
    ])
    ptu, paygo, oai, local = parse_upstreams(raw, ENV)
    assert (ptu.kind, ptu.url, ptu.api_version, ptu.auth) == ("azure", "https://ptu.openai.azure.com", "2024-10-21",
                                                              "entra")
    assert ptu.models == ("gpt-4o",) and ptu.deployment("gpt-4o") == "gpt4o-ptu"
    assert (paygo.api_version, paygo.auth, paygo.api_key.get_secret_value(), paygo.weight) == (
        "2025-01-01", "key", SECRET, 2.0)
    assert (oai.kind, oai.base_url, oai.azure_endpoint, oai.key_setting) == (
        "openai", "https://api.openai.com/v1", None, "OPENAI_KEY")
    assert (local.auth, local.priority, local.weight, local.models) == ("none", 4, 1.0, None)


BAD = [
    ("not json", "{", "UPSTREAMS: not valid JSON"),
    ("not a list", {"name": "a", "base_url": "http://a"}, "UPSTREAMS: must be a JSON list"),
    ("empty", [], "UPSTREAMS: the list is empty"),
    ("not an object", ["a"], "UPSTREAMS[0]: must be a JSON object"),
    ("nan", '[{"name": "a", "base_url": "http://a", "weight": NaN}]', "NaN is not a JSON number"),
    ("duplicate json key", '[{"name": "a", "base_url": "http://a", "name": "b"}]', 'the key "name" appears twice'),
    ("unknown key", [{"name": "eastus", "base_url": "http://a", "region": "eastus"}],
     'UPSTREAMS[0] ("eastus"): region: unknown key'),
    ("a key inline", [{"name": "eastus", "base_url": "http://a", "api_key": SECRET}],
     'UPSTREAMS[0] ("eastus"): api_key: unknown key (a key never goes in UPSTREAMS'),
    ("no name", [{"base_url": "http://a"}], "UPSTREAMS[0]: name: Field required"),
    ("bad name", [{"name": "east us", "base_url": "http://a"}], "name: use letters, digits"),
    ("duplicate name", [{"name": "eastus", "base_url": "http://a"}, {"name": "EastUS", "base_url": "http://b"}],
     'UPSTREAMS[1] ("EastUS"): name: the same name as UPSTREAMS[0]'),
    ("both urls", [{"name": "a", "base_url": "http://a", "azure_endpoint": "https://a"}],
     'UPSTREAMS[0] ("a"): needs exactly one of base_url'),
    ("neither url", [{"name": "a", "priority": 2}], 'UPSTREAMS[0] ("a"): needs exactly one of base_url'),
    ("weight 0", [{"name": "a", "base_url": "http://a", "weight": 0}], "weight: Input should be greater than 0"),
    ("weight < 0", [{"name": "a", "base_url": "http://a", "weight": -1}], "weight: Input should be greater than 0"),
    ("weight a string", [{"name": "a", "base_url": "http://a", "weight": "2"}], "weight: Input should be a valid number"),
    ("priority 1.5", [{"name": "a", "base_url": "http://a", "priority": 1.5}], "priority: Input should be a valid integer"),
    ("priority a string", [{"name": "a", "base_url": "http://a", "priority": "1"}], "priority: Input should be a valid"),
    ("priority true", [{"name": "a", "base_url": "http://a", "priority": True}], "priority: Input should be a valid"),
    ("priority < 0", [{"name": "a", "base_url": "http://a", "priority": -1}], "priority: Input should be greater"),
    ("missing key setting", [{"name": "eastus-paygo", "azure_endpoint": "https://a", "api_key_setting": "NOPE"}],
     'UPSTREAMS[0] ("eastus-paygo"): api_key_setting: the app setting NOPE is not set or empty'),
    ("empty key setting", [{"name": "a", "base_url": "http://a", "api_key_setting": "EMPTY"}],
     "the app setting EMPTY is not set or empty"),
    ("unresolved key vault reference", [{"name": "a", "base_url": "http://a", "api_key_setting": "KV"}],
     "holds an unresolved Key Vault reference"),
    ("bad setting name", [{"name": "a", "base_url": "http://a", "api_key_setting": "MY-KEY"}],
     "api_key_setting: must be the name of an app setting"),
    ("url without scheme", [{"name": "a", "base_url": "api.openai.com/v1"}], "base_url: must be an http:// or https://"),
    ("ftp url", [{"name": "a", "azure_endpoint": "ftp://a"}], "azure_endpoint: must be an http:// or https://"),
    ("url with credentials", [{"name": "a", "base_url": f"https://u:{SECRET}@a/v1"}], "must not carry credentials"),
    ("url with a bad port", [{"name": "a", "base_url": "http://a:99999/v1"}], "base_url: is not a valid URL"),
    ("url with a query", [{"name": "a", "base_url": f"http://a/v1?key={SECRET}"}], "must not have a query"),
    ("url not a string", [{"name": "a", "base_url": 5}], "base_url: Input should be a valid string"),
    ("api_version on openai", [{"name": "a", "base_url": "http://a", "api_version": "x"}],
     "api_version: only for an azure_endpoint entry"),
    ("deployments on openai", [{"name": "a", "base_url": "http://a", "deployments": {"m": "d"}}],
     "deployments: only for an azure_endpoint entry"),
    ("deployment of an unlisted model", [{"name": "a", "azure_endpoint": "https://a", "models": ["m"],
                                          "deployments": {"n": "d"}}], "deployments: maps 'n', which models does not"),
    ("empty models", [{"name": "a", "base_url": "http://a", "models": []}], "models: List should have at least 1"),
    ("models not a list", [{"name": "a", "base_url": "http://a", "models": "gpt-4o"}], "models: Input should be a valid list"),
    ("model listed twice", [{"name": "a", "base_url": "http://a", "models": ["m", "m"]}], "models: a model is listed twice"),
]


@pytest.mark.parametrize("value, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_upstreams_values_are_refused_with_a_clear_message(value, expected):
    raw = value if isinstance(value, str) else json.dumps(value)
    env = dict(ENV, EMPTY="", KV="@Microsoft.KeyVault(SecretUri=https://kv.vault.azure.net/secrets/k/)")
    with pytest.raises(PoolConfigError) as caught:
        parse_upstreams(raw, env)
    message = str(caught.value)
    assert expected in message
    assert SECRET not in message and "vault.azure.net" not in message
    # No chained error (pydantic's own text quotes the input) reaches a traceback.
    assert caught.value.__cause__ is None and (caught.value.__context__ is None or caught.value.__suppress_context__)


def test_every_problem_is_listed_at_once():
    raw = json.dumps([{"name": "a", "base_url": "http://a", "weight": 0},
                      {"name": "b", "base_url": "http://b"},
                      {"name": "c", "azure_endpoint": "https://c", "api_key_setting": "C_KEY"}])
    with pytest.raises(PoolConfigError) as caught:
        parse_upstreams(raw, {})
    assert 'UPSTREAMS[0] ("a"): weight' in str(caught.value)
    assert 'UPSTREAMS[2] ("c"): api_key_setting' in str(caught.value)
    assert "UPSTREAMS[1]" not in str(caught.value)


def test_without_upstreams_the_legacy_settings_form_a_one_entry_pool():
    pool = Pool.from_settings(None, {}, {"kind": "azure", "endpoint": "https://r.openai.azure.com/",
                                         "api_version": "2024-10-21", "api_key": None})
    (only,) = pool.entries
    assert (only.name, only.kind, only.url, only.auth, only.models) == (
        "default", "azure", "https://r.openai.azure.com", "entra", None)
    pool = Pool.from_settings("", {}, {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": SECRET})
    assert pool.entries[0].api_key.get_secret_value() == SECRET and pool.entries[0].kind == "openai"
    assert pool.entries[0].deployment("any-model") == "any-model"
    empty = Pool.from_settings(None, {}, {"kind": "none"})
    assert not empty.configured and empty.candidates("m") == [] and empty.retry_after("m") is None


def test_upstreams_wins_over_the_legacy_settings():
    raw = json.dumps([{"name": "openai", "base_url": "https://api.openai.com/v1", "api_key_setting": "OPENAI_API_KEY"}])
    pool = Pool.from_settings(raw, {"OPENAI_API_KEY": SECRET}, {"kind": "openai", "api_key": SECRET})
    assert names(pool.entries) == ["openai"]


# --- a property ---------------------------------------------------------------------------------

OUTCOMES = [Outcome.success(), SERVER_ERROR, CONNECT_FAILED, Outcome(OutcomeKind.TIMEOUT),
            Outcome.rate_limited({"retry-after": "7"}), Outcome.rate_limited({}), Outcome.from_status(400),
            Outcome.from_status(401)]

step = st.one_of(
    st.tuples(st.just("advance"), st.floats(0, 400)),
    st.tuples(st.just("report"), st.integers(0, 4), st.sampled_from(["m1", "m2"]), st.sampled_from(OUTCOMES)),
    st.tuples(st.just("hold"), st.integers(0, 4), st.sampled_from(["m1", "m2"])),
    st.tuples(st.just("release"), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(priorities=st.lists(st.integers(0, 3), min_size=5, max_size=5), steps=st.lists(step, max_size=60),
       seed=st.integers(0, 2**32))
def test_candidates_are_never_unavailable_entries_and_always_sorted_by_priority(priorities, steps, seed):
    entries = [entry(f"e{i}", p, weight=1 + i, models=None if i % 2 else ["m1"]) for i, p in enumerate(priorities)]
    pool, clock = make_pool(*entries, seed=seed)
    held = []
    for s in steps:
        if s[0] == "advance":
            clock.advance(s[1])
        elif s[0] == "report":
            a = pool.acquire(entries[s[1]], s[2])
            if a is not None:
                a.report(s[3])
        elif s[0] == "hold":
            a = pool.acquire(entries[s[1]], s[2])
            if a is not None:
                held.append(a)
        elif held:
            held.pop(s[1] % len(held)).release()
        for model in ("m1", "m2"):
            found = pool.candidates(model)
            assert [e.priority for e in found] == sorted(e.priority for e in found)
            state = {s["name"]: s for s in pool.state()}
            for e in found:
                st_ = state[e.name]
                assert e.serves(model)
                assert st_["state"] in ("ok", "cooling_down", "half_open")
                assert e.deployment(model) not in st_["cooldowns"]
                assert not st_["probing"]
            # retry_after is set exactly when entries serve the model and none is free.
            assert (pool.retry_after(model) is None) == (bool(found) or not pool.serves(model))
            if found:  # the first candidate can really be taken (then let go)
                taken = pool.acquire(found[0], model)
                assert taken is not None
                taken.release()


def test_a_report_after_release_is_not_taken_for_the_probe():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    with pool.acquire(pool.entry("a"), "gpt-4o") as cancelled_probe:
        pass
    probe = attempt(pool, "a")
    cancelled_probe.report(Outcome.success())  # late, after its slot was given back: no effect
    assert pool.state()[0]["state"] == "half_open" and pool.state()[0]["probing"]
    probe.report(SERVER_ERROR)
    assert pool.state()[0]["state"] == "open" and pool.state()[0]["until"] == pytest.approx(10)


def test_the_examples_in_docs_pool_md_are_valid():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "pool.md").read_text()
    examples = [block for block in re.findall(r"```json\n(.*?)```", text, re.S) if block.lstrip().startswith("[")]
    assert len(examples) == 2
    ptu = parse_upstreams(examples[0], {"AOAI_WESTUS3_KEY": SECRET})
    assert [(e.name, e.priority, e.weight, e.auth) for e in ptu] == [
        ("ptu-swedencentral", 1, 1.0, "entra"), ("paygo-eastus2", 2, 2.0, "entra"), ("paygo-westus3", 2, 1.0, "key")]
    pool, _ = make_pool(*ptu)
    assert names(pool.candidates("gpt-4o"))[0] == "ptu-swedencentral"
    assert "ptu-swedencentral" not in names(pool.candidates("gpt-4o-mini"))
    last_resort = parse_upstreams(examples[1], {"OPENAI_API_KEY": SECRET})
    assert [e.deployment("gpt-4o") for e in last_resort] == ["prod-gpt4o", "prod-gpt4o", "gpt-4o"]


def test_an_error_event_in_the_stream_is_the_entrys_failure_for_every_api():
    """Chat completions' error event arrives as openai.APIError; the Responses API's `error` event as
    UpstreamReported: both move the request on and count against the entry (review finding: the
    Responses one was OTHER, so it neither failed over nor counted)."""
    from chatstream.errors import UpstreamReported
    from chatstream.failover import outcome_of
    for exc in (UpstreamReported("overloaded"), openai.APIError("overloaded", _request(), body=None)):
        outcome = outcome_of(exc)
        assert outcome.kind is OutcomeKind.SERVER_ERROR and outcome.failover
