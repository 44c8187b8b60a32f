"""Thousands of generated bodies against the endpoint: never a 5xx, never a hang, never an upstream
request for a body that was refused, and every accepted one ends with one last event.

The thousands go to the app's endpoint served in this process (helpers.InProcessApp: the same
create_app, without the local host and the worker in between, so each example costs milliseconds);
a smaller sample goes through the local host on the real runtime, end to end."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import InProcessApp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

FIELDS = ["prompt", "messages", "model", "temperature", "top_p", "max_tokens", "seed", "stop"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "", "USER"]),
            "content": st.one_of(st.text(max_size=40), scalars),
        },
        optional={"name": st.text(max_size=5)},
    ),
    max_size=4,
)
field_values = {
    "prompt": st.one_of(st.text(max_size=60), json_values),
    "messages": st.one_of(messages, json_values),
    "model": st.one_of(st.text(max_size=20), json_values),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), json_values),
    "max_tokens": st.one_of(st.integers(-5, 10**7), json_values),
    "seed": st.one_of(st.integers(-(2**65), 2**65), json_values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_values),
}
good_text = st.text(min_size=1, max_size=40).filter(lambda t: t.strip() and "[scenario:" not in t)
valid_bodies = st.one_of(
    st.fixed_dictionaries(
        {"prompt": good_text},
        optional={
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0, 1),
            "max_tokens": st.integers(1, 4096),
            "seed": st.integers(-(2**63), 2**63 - 1),
            "stop": st.one_of(good_text, st.lists(good_text, min_size=1, max_size=4)),
        },
    ),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["system", "assistant"]), "content": st.text(max_size=20)}
                ),
                max_size=3,
            ).flatmap(lambda rest: st.just(rest + [{"role": "user", "content": "hello"}]))
        }
    ),
)


@st.composite
def mutated(draw):
    """A valid body with one field replaced by anything, or one unknown field added."""
    body = dict(draw(valid_bodies))
    key = draw(st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=10)))
    body[key] = draw(json_values)
    return body


bodies = st.one_of(
    valid_bodies,
    mutated(),
    st.fixed_dictionaries({}, optional=field_values),  # known fields, good and bad values
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), json_values, max_size=5),
    json_values,
)
raw_bytes = st.one_of(st.binary(max_size=200), st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))


@pytest.fixture(scope="module")
def inproc(upstream):
    app = InProcessApp(upstream.base_url)
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(upstream):
    # Accepted bodies are answered by the upstream's default scenario; `length` (4 quick deltas)
    # instead of `echo` (30 ms per word of the prompt) keeps thousands of examples fast.
    upstream.http.post("/_scripted/default", json={"scenario": "length"}).raise_for_status()
    with httpx.Client(timeout=httpx.Timeout(10.0)) as c:
        yield c
    upstream.http.post("/_scripted/default", json={"scenario": "echo"}).raise_for_status()


def check(client, app, upstream, content: bytes, content_type: str = "application/json") -> None:
    before = upstream.count()
    with client.stream("POST", app.chat_url, content=content, headers={"content-type": content_type}) as r:
        body = r.read()
    event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, content[:200], body[:300])
    if r.status_code == 200:
        events = [line for line in body.decode().splitlines() if line.startswith("event:")]
        assert events in (["event: done"], ["event: error"]), body[-300:]
    else:
        assert r.status_code in (400, 413, 415), (r.status_code, body)
        error = json.loads(body)["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str)
        assert upstream.count() == before, f"refused body reached the upstream: {content[:200]!r}"


CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
]


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_generated_json_bodies(client, inproc, upstream, body):
    check(client, inproc, upstream, json.dumps(body).encode())


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(content=raw_bytes, content_type=st.sampled_from(CONTENT_TYPES))
def test_generated_raw_bodies(client, inproc, upstream, content, content_type):
    check(client, inproc, upstream, content, content_type)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_generated_json_bodies_through_the_local_host(client, app, upstream, body):
    check(client, app, upstream, json.dumps(body).encode())


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(content=raw_bytes, content_type=st.sampled_from(CONTENT_TYPES))
def test_generated_raw_bodies_through_the_local_host(client, app, upstream, content, content_type):
    check(client, app, upstream, content, content_type)
