"""chatstream/pool.py in-process: UPSTREAMS validation, the order entries are tried in, 429
cooldowns, the breaker, and classifying the openai SDK's exceptions. A fake clock drives time."""

from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from chatstream.settings import Settings, SettingsError
from chatstream.upstreams.config import Entry
from chatstream.upstreams.outcomes import (
    SUCCESS,
    Outcome,
    OutcomeKind,
    cooldown_from_headers,
    outcome_of_status,
)
from chatstream.upstreams.pool import Pool

from .upstream_helpers import (
    CONNECT_FAILED,
    SECRET,
    SERVER_ERROR,
    Clock,
    attempt,
    entry,
    make_pool,
    named,
    names,
    outcome_of,
    retry_after,
    status_error,
)

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
    assert abs(orders[("a", "b", "c")] / draws - 0.3) < 0.03, orders  # 3/5 · 1/2


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
    assert retry_after(pool_without_catch_all, "llama3") is None  # not served: a 400, not a 429


# --- 429 cooldowns ----------------------------------------------------------------------------


def test_a_429_with_retry_after_takes_the_entry_out_for_that_long_then_back():
    pool, clock = make_pool(entry("ptu", 1), entry("paygo", 2))
    attempt(pool, "ptu", outcome=outcome_of(status_error(429, {"retry-after": "30"})))
    assert names(pool.candidates("gpt-4o")) == ["paygo"]
    clock.advance(29.9)
    assert names(pool.candidates("gpt-4o")) == ["paygo"]
    clock.advance(0.1)
    assert names(pool.candidates("gpt-4o")) == ["ptu", "paygo"]


def test_a_cooldown_is_per_deployment_not_per_entry():
    pool, _ = make_pool(entry("azure"), entry("other", 2))
    attempt(pool, "azure", "gpt-4o", outcome_of_status(429, {"retry-after": "30"}))
    assert names(pool.candidates("gpt-4o")) == ["other"]
    assert names(pool.candidates("gpt-4o-mini")) == ["azure", "other"]


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({"retry-after": "30"}, 30),
        ({"Retry-After": "2.5"}, 2.5),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "1500", "retry-after": "2"}, 2),  # the largest
        ({"x-ratelimit-reset-requests": "7"}, 7),  # Azure: seconds
        ({"x-ratelimit-reset-tokens": "12.5", "x-ratelimit-reset-requests": "1"}, 12.5),
        ({"x-ratelimit-reset-tokens": "6m0s"}, 360),  # OpenAI: a duration
        ({"x-ratelimit-reset-requests": "1m30.5s"}, 90.5),
        ({"x-ratelimit-reset-requests": "20ms", "retry-after-ms": "10"}, 0.02),
        ({"x-ratelimit-reset-tokens": "0", "x-ratelimit-reset-requests": "-1"}, None),  # Azure's placeholders
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        (
            {"retry-after": "0"},
            None,
        ),  # ignored, as docs/pool.md says: a 429 that asks for no wait cools for the default
        ({}, None),
    ],
)
def test_cooldown_from_headers(headers, expected):
    assert cooldown_from_headers(headers, wall_now=0) == expected


def test_retry_after_as_an_http_date():
    wall = 1_700_000_000.0
    date = email.utils.formatdate(wall + 45, usegmt=True)
    assert cooldown_from_headers({"Retry-After": date}, wall_now=wall) == pytest.approx(45)
    past = email.utils.formatdate(wall - 45, usegmt=True)
    assert cooldown_from_headers({"Retry-After": past}, wall_now=wall) is None  # ignored: the default applies


@pytest.mark.parametrize(
    "headers, seconds",
    [
        ({"retry-after-ms": "4000"}, 4),
        ({"x-ratelimit-reset-tokens": "20"}, 20),
        ({}, 10),  # no header: the default
        ({"retry-after": "0"}, 10),  # no usable wait: the default (docs/pool.md)
        ({"retry-after": "0.2"}, 1),  # the shortest cooldown
        ({"retry-after": "86400"}, 300),  # capped (Azure asks for a day when a quota is spent)
    ],
)
def test_the_pool_applies_cooldowns_with_a_default_a_floor_and_a_cap(headers, seconds):
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=outcome_of_status(429, headers))
    assert retry_after(pool, "gpt-4o") == pytest.approx(seconds)
    clock.advance(seconds - 0.01)
    assert pool.candidates("gpt-4o") == []
    clock.advance(0.01)
    assert names(pool.candidates("gpt-4o")) == ["a"]


def test_when_every_entry_is_cooling_down_retry_after_is_the_soonest():
    pool, clock = make_pool(entry("a"), entry("b"), entry("c", 2))
    assert retry_after(pool, "gpt-4o") is None
    attempt(pool, "a", outcome=outcome_of_status(429, {"retry-after": "30"}))
    attempt(pool, "b", outcome=outcome_of_status(429, {"retry-after": "12"}))
    assert retry_after(pool, "gpt-4o") is None  # c is still free
    attempt(pool, "c", outcome=outcome_of_status(429, {"retry-after": "20"}))
    assert pool.candidates("gpt-4o") == []
    assert retry_after(pool, "gpt-4o") == pytest.approx(12)
    assert pool.unavailable("gpt-4o").reason == "rate_limited"
    clock.advance(5)
    assert retry_after(pool, "gpt-4o") == pytest.approx(7)
    clock.advance(7)
    assert retry_after(pool, "gpt-4o") is None
    assert names(pool.candidates("gpt-4o")) == ["b"]


def test_an_insufficient_quota_429_cools_down_for_the_maximum_and_is_a_config_problem(caplog):
    clock = Clock()
    pool = Pool([entry("openai")], now=clock)
    outcome = outcome_of(status_error(429, {"retry-after": "1"}, body={"code": "insufficient_quota"}))
    assert outcome.kind is OutcomeKind.QUOTA_EXHAUSTED and outcome.failover
    with caplog.at_level(logging.INFO, logger="chatstream"):
        attempt(pool, "openai", outcome=outcome)
    assert retry_after(pool, "gpt-4o") == pytest.approx(300)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "upstream openai: its quota is used up (insufficient_quota): check the account's billing"),
        ("WARNING", "upstream openai: quota_exhausted, cooling down 300.0s for gpt-4o"),
    ]


# --- the breaker ------------------------------------------------------------------------------


def test_three_consecutive_server_errors_open_the_breaker_and_a_success_resets_the_count():
    pool, _ = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=SERVER_ERROR)
    attempt(pool, "a", outcome=SERVER_ERROR)
    attempt(pool, "a", outcome=SUCCESS)
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


def test_the_back_off_grows_to_the_probe_interval_then_a_half_open_probe_closes_the_breaker():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    for backoff in (5, 10, 10, 10, 10, 10):  # Policy(): UPSTREAM_OPEN_SECONDS 5, UPSTREAM_PROBE_SECONDS 10
        attempt(pool, "a", outcome=CONNECT_FAILED)  # opens (from closed), or the probe fails: reopens
        assert pool.state()[0]["state"] == "open"
        assert pool.state()[0]["until"] == pytest.approx(backoff)
        assert pool.state()[0]["next_probe"] == pytest.approx(backoff)
        clock.advance(backoff - 0.01)
        assert names(pool.candidates("gpt-4o")) == ["b"]
        clock.advance(0.01)
        assert pool.state()[0]["state"] == "half_open" and pool.state()[0]["next_probe"] == 0
        assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    probe = attempt(pool, "a")
    assert probe.probe
    probe.report(SUCCESS)
    assert pool.state()[0]["state"] == "ok" and pool.state()[0]["next_probe"] is None
    # Closed again: the next opening starts from the first back-off.
    attempt(pool, "a", outcome=CONNECT_FAILED)
    assert pool.state()[0]["until"] == pytest.approx(5)


def test_a_long_history_of_failed_probes_still_probes_at_the_probe_interval():
    pool, clock = make_pool(entry("a"), entry("b", 2), backoff_initial=1.0, backoff_max=3.0)
    for backoff in (1, 2, 3, *(3,) * 50):
        attempt(pool, "a", outcome=CONNECT_FAILED)
        assert pool.state()[0]["until"] == pytest.approx(backoff)
        clock.advance(backoff)
    assert attempt(pool, "a").probe


def test_only_one_probe_at_a_time():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    first, second = pool.candidates("gpt-4o"), pool.candidates("gpt-4o")
    assert names(first) == names(second) == ["a", "b"]  # both requests see it free…
    probe = pool.acquire(first[0], "gpt-4o")
    assert probe is not None and probe.probe
    assert pool.acquire(second[0], "gpt-4o") is None  # …only one gets the probe
    assert names(pool.candidates("gpt-4o")) == ["b"]
    state = pool.state()[0]
    assert state["state"] == "half_open" and state["probing"]
    probe.report(SUCCESS)
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    assert pool.acquire(named(pool, "a"), "gpt-4o").probe is False


def test_when_the_only_entry_is_being_probed_retry_after_is_short():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    assert pool.unavailable("gpt-4o").reason == "unavailable"
    assert retry_after(pool, "gpt-4o") == pytest.approx(5)
    clock.advance(5)
    probe = attempt(pool, "a")
    assert retry_after(pool, "gpt-4o") == pytest.approx(1)
    probe.report(SERVER_ERROR)  # the probe failed: reopened, longer
    assert retry_after(pool, "gpt-4o") == pytest.approx(10)


def test_a_cancelled_probe_frees_its_slot_and_the_entry_stays_half_open():
    pool, clock = make_pool(entry("a"), entry("b", 2))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    probe = pool.acquire(named(pool, "a"), "gpt-4o")
    with pytest.raises(KeyboardInterrupt):  # any BaseException, as asyncio.CancelledError is
        try:
            assert probe.probe
            raise KeyboardInterrupt
        finally:
            probe.release()  # as the request path does when it is cancelled
    assert pool.state()[0]["state"] == "half_open" and not pool.state()[0]["probing"]
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
    again = pool.acquire(named(pool, "a"), "gpt-4o")
    assert again.probe
    again.release()
    again.release()  # idempotent
    assert pool.acquire(named(pool, "a"), "gpt-4o").probe


def test_a_probe_slot_is_released_when_the_task_is_cancelled():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)

    async def main():
        started = asyncio.Event()

        async def request():
            probe = pool.acquire(named(pool, "a"), "gpt-4o")
            try:
                started.set()
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                probe.release()  # as failover.Upstreams does
                raise

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
    attempt(pool, "a", outcome=outcome_of_status(429, {"retry-after": "3"}))
    state = pool.state()[0]
    assert state["state"] == "cooling_down" and state["cooldowns"] == {"gpt-4o": 3}
    clock.advance(3)
    assert pool.state()[0]["state"] == "ok"


def test_attempts_started_before_the_breaker_opened_do_not_move_it():
    pool, clock = make_pool(entry("a"))
    slow = [attempt(pool, "a") for _ in range(3)]
    attempt(pool, "a", outcome=CONNECT_FAILED)  # opens
    slow[0].report(SUCCESS)  # stale: stays open
    assert pool.state()[0]["state"] == "open"
    clock.advance(5)
    probe = attempt(pool, "a")
    slow[1].report(SERVER_ERROR)  # stale: does not reopen, keeps the probe
    assert pool.state()[0]["probing"]
    probe.report(SUCCESS)
    slow[2].report(SERVER_ERROR)  # stale (previous era): no count
    assert pool.state()[0]["consecutive_failures"] == 0


def test_client_errors_and_auth_errors_do_not_touch_the_entrys_health(caplog):
    """401 and 403 are our configuration's problem: an error log naming the entry, nothing else."""
    clock = Clock()
    pool = Pool([entry("a")], now=clock)
    with caplog.at_level(logging.INFO, logger="chatstream"):
        for status in (400, 401, 403, 404, 413, 422) * 3:
            attempt(pool, "a", outcome=outcome_of(status_error(status)))
    state = pool.state()[0]
    assert state["state"] == "ok" and state["consecutive_failures"] == 0
    assert state["counters"]["failures"] == 0 and state["counters"]["failovers"] == 0
    auth = "upstream a: authentication failed: check its key (api_key_setting) or, for Entra ID, the app"
    assert [(r.levelname, r.getMessage()[: len(auth)]) for r in caplog.records] == [("ERROR", auth)] * 6


def test_a_mid_stream_failure_counts_against_the_entry_but_not_as_a_failover():
    pool, _ = make_pool(entry("a"))
    a = attempt(pool, "a")
    a.report(SUCCESS)  # the first delta
    a.report(Outcome(OutcomeKind.CONNECTION_LOST))
    counters = pool.state()[0]["counters"]
    assert counters == {"requests": 1, "successes": 1, "failures": 1, "failovers": 0, "cooldowns": 0, "opens": 0}
    assert pool.state()[0]["consecutive_failures"] == 1


def test_state_reports_each_entry_without_any_key():
    ptu = Entry(
        name="ptu",
        kind="azure",
        url="https://ptu.openai.azure.com",
        api_version="2024-10-21",
        api_key=None,
        priority=1,
        models=("gpt-4o",),
        deployments={"gpt-4o": "gpt4o-ptu"},
    )
    openai_entry = Entry("default", "openai", "https://user:pw@api.openai.com/v1", api_key=SecretStr(SECRET))
    pool, clock = make_pool(ptu, openai_entry)
    attempt(pool, "ptu", outcome=outcome_of_status(429, {"retry-after": "30"}))
    attempt(pool, "default", outcome=SERVER_ERROR)
    clock.advance(10)
    state = pool.state()
    assert state[0] == {
        "name": "ptu",
        "kind": "azure",
        "url": "https://ptu.openai.azure.com",
        "auth": "entra",
        "key_setting": None,
        "priority": 1,
        "weight": 1.0,
        "models": ["gpt-4o"],
        "state": "cooling_down",
        "until": 20.0,
        "probing": False,
        "next_probe": None,
        "cooldowns": {"gpt4o-ptu": 20.0},
        "consecutive_failures": 0,
        "counters": {"requests": 1, "successes": 0, "failures": 0, "failovers": 1, "cooldowns": 1, "opens": 0},
    }
    assert state[1]["auth"] == "key" and state[1]["consecutive_failures"] == 1
    assert state[1]["url"] == "https://api.openai.com/v1"
    text = json.dumps(state) + repr(pool.entries) + repr(openai_entry)
    assert SECRET not in text and "pw" not in text


# --- a property ---------------------------------------------------------------------------------

OUTCOMES = [
    SUCCESS,
    SERVER_ERROR,
    CONNECT_FAILED,
    Outcome(OutcomeKind.TIMEOUT),
    outcome_of_status(429, {"retry-after": "7"}),
    outcome_of_status(429, {}),
    outcome_of_status(400),
    outcome_of_status(401),
]

step = st.one_of(
    st.tuples(st.just("advance"), st.floats(0, 400)),
    st.tuples(st.just("report"), st.integers(0, 4), st.sampled_from(["m1", "m2"]), st.sampled_from(OUTCOMES)),
    st.tuples(st.just("hold"), st.integers(0, 4), st.sampled_from(["m1", "m2"])),
    st.tuples(st.just("release"), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(
    priorities=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    steps=st.lists(step, max_size=60),
    seed=st.integers(0, 2**32),
)
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
            assert (retry_after(pool, model) is None) == (bool(found) or not pool.serves(model))
            if found:  # the first candidate can really be taken (then let go)
                taken = pool.acquire(found[0], model)
                assert taken is not None
                taken.release()


def test_a_report_after_release_is_not_taken_for_the_probe():
    pool, clock = make_pool(entry("a"))
    attempt(pool, "a", outcome=CONNECT_FAILED)
    clock.advance(5)
    cancelled_probe = pool.acquire(named(pool, "a"), "gpt-4o")
    cancelled_probe.release()
    probe = attempt(pool, "a")
    cancelled_probe.report(SUCCESS)  # late, after its slot was given back: no effect
    assert pool.state()[0]["state"] == "half_open" and pool.state()[0]["probing"]
    probe.report(SERVER_ERROR)
    assert pool.state()[0]["state"] == "open" and pool.state()[0]["until"] == pytest.approx(10)


# --- routing by error class (UPSTREAM_ERROR_ROUTES) ------------------------------------------------


@pytest.mark.parametrize(
    "status, code, message, kind",
    [
        (400, "context_length_exceeded", "too long", OutcomeKind.CONTEXT_LENGTH),
        (400, None, "This model's maximum context length is 4096 tokens. However, ...", OutcomeKind.CONTEXT_LENGTH),
        (400, "content_policy_violation", "rejected", OutcomeKind.CONTENT_FILTER),
        (400, "content_filter", "filtered (Azure)", OutcomeKind.CONTENT_FILTER),
        (400, "invalid_value", "temperature", OutcomeKind.CLIENT_ERROR),
        (429, "insufficient_quota", "billing", OutcomeKind.QUOTA_EXHAUSTED),
        (401, "invalid_api_key", "key", OutcomeKind.AUTH_ERROR),
    ],
)
def test_error_classes_are_read_from_the_code_or_the_words(status, code, message, kind):
    assert outcome_of_status(status, {}, code, message).kind is kind


def test_the_default_routes_and_configured_ones():
    pool, _ = make_pool(entry("a"), entry("b", 2))
    route = {kind: pool.route(Outcome(kind)) for kind in OutcomeKind}
    assert route[OutcomeKind.CONTEXT_LENGTH] == "larger"
    assert route[OutcomeKind.CONTENT_FILTER] == "stop", "a filtered prompt is filtered elsewhere too"
    assert route[OutcomeKind.AUTH_ERROR] == route[OutcomeKind.QUOTA_EXHAUSTED] == "next"
    assert route[OutcomeKind.CLIENT_ERROR] == route[OutcomeKind.OTHER] == "stop"
    assert route[OutcomeKind.SERVER_ERROR] == route[OutcomeKind.RATE_LIMITED] == "next"
    configured = Pool(
        pool.entries, routes=Settings.from_env({"UPSTREAM_ERROR_ROUTES": "auth=stop, content_filter=next"}).error_routes
    )
    assert configured.route(Outcome(OutcomeKind.AUTH_ERROR)) == "stop"
    assert configured.route(Outcome(OutcomeKind.CONTENT_FILTER)) == "next"
    assert configured.route(Outcome(OutcomeKind.CONTEXT_LENGTH)) == "larger"


@pytest.mark.parametrize("value", ["context=larger", "auth=larger", "quota=wait", "content_filter"])
def test_a_bad_error_route_stops_the_app_naming_the_setting(value):
    with pytest.raises(SettingsError, match="UPSTREAM_ERROR_ROUTES"):
        Settings.from_env({"UPSTREAM_ERROR_ROUTES": value})


def test_the_callers_bad_input_never_counts_against_an_entry():
    pool, _ = make_pool(entry("a"), entry("b", 2))
    for outcome in (
        outcome_of_status(400, {}, "invalid_value", "bad temperature"),
        outcome_of_status(404, {}, "model_not_found"),
        outcome_of_status(413),
        outcome_of_status(422),
        outcome_of_status(400, {}, "context_length_exceeded"),
        outcome_of_status(400, {}, "content_policy_violation"),
    ):
        for _ in range(5):
            attempt(pool, "a", outcome=outcome)
    state = pool.state()[0]
    assert state["state"] == "ok" and state["consecutive_failures"] == 0 and state["counters"]["failures"] == 0
    assert names(pool.candidates("gpt-4o")) == ["a", "b"]
