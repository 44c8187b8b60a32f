"""The shared state of one or more app instances on one in-process store (tests/memory_store.py), wired
as the app wires it (state/shared.py), for the unit tests of accounting, the journal and the admin API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from memory_store import Fault, MemoryData, MemoryStore

from chatstream.apis.usage import admission_request, request_usage
from chatstream.pipeline import CallRequest
from chatstream.record import Segment, StreamRecord
from chatstream.settings import Settings
from chatstream.state.accounting import Accounting, Admission
from chatstream.state.instances import InstanceTiming
from chatstream.state.port import AdmissionRequest
from chatstream.state.shared import SharedState
from chatstream.state.store import LIMITS_TABLE

# 17.3 s into a minute (and a UTC day and month): a test that runs for less than 40 s stays in one
# window of each, whatever the time of day it runs at.
T0 = 1_796_083_217.3
MODEL = "gpt-4o"


def ticking(start: float = T0) -> Callable[[], float]:
    """A store clock that starts at ``start`` and runs as real time does."""
    origin = time.monotonic()
    return lambda: start + (time.monotonic() - origin)


def account(**kw: Any) -> MemoryData:
    """One simulated storage account, its clock at T0."""
    return MemoryData(wall=ticking(), **kw)


def settings(**env: str) -> Settings:
    return Settings.from_env({"CALLER_KEYS": "required", **env})


def instance(
    data: MemoryData, name: str, timing: InstanceTiming | None = None, journal_seconds: float = 0.05, **env: str
) -> tuple[SharedState, Accounting]:
    """One app instance on the account: its own store client (and clock), as SharedState.on makes it;
    its journal written at most every ``journal_seconds`` (the app's 0.5 s makes tests slow)."""
    store = MemoryStore(data)
    state = SharedState.on(store, settings(**env), timing, instance_id=name)
    state.journal.interval = journal_seconds
    assert state.accounting is not None
    return state, state.accounting


async def kill(state: SharedState) -> None:
    """The instance dies: from now on none of its calls reaches the store (its tasks stop where they
    are: nothing is flushed, nothing says goodbye)."""
    store = state.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("unavailable", times=10**9))
    for part in (state.counters, state.journal, state.instances):
        await part.close()


def call(text: str = "hello", model: str = MODEL, endpoint: str = "openai", **params: Any) -> CallRequest:
    return CallRequest(
        params={"model": model, "messages": [{"role": "user", "content": text}], **params}, endpoint=endpoint
    )


def record(model: str = MODEL) -> StreamRecord:
    return StreamRecord(endpoint="openai", model=model)


def asked(request: CallRequest, rec: StreamRecord) -> AdmissionRequest:
    """What the endpoint asks the state for ``request`` (the app's default output cap, 4096)."""
    return admission_request(request, rec, 4096)


async def admit(accounting: Accounting, caller, text: str = "hello", model: str = MODEL, **params: Any):
    """(answer, record) for one request of ``caller``."""
    rec = record(model)
    return await accounting.admit(caller, asked(call(text, model, **params), rec)), rec


def charge(
    accounting: Accounting,
    admission: Admission,
    rec: StreamRecord,
    generated: Mapping[int, list[str]] | None = None,
    segments: list[Segment] | None = None,
) -> None:
    """The request is over: its charge, and its cost for its log line, as the endpoint asks them;
    ``segments``: the streams a continued answer was read from."""
    rec.segments.extend(segments or ())
    used = request_usage(admission.entry.model, admission.entry.prompt_tokens, rec, generated)
    rec.cost = accounting.charge(admission, used)


def finish(
    accounting: Accounting,
    admission: Admission,
    rec: StreamRecord,
    usage: Mapping[str, Any] | None = None,
    generated: Mapping[int, list[str]] | None = None,
    answered: bool = True,
    **facts: Any,
) -> None:
    """The request is over: what the upstream reported (``usage``), or only what it generated."""
    if answered:
        rec.upstream_answered()
        rec.upstream = "main"
    rec.usage = dict(usage) if usage is not None else None
    for name, value in facts.items():
        setattr(rec, name, value)
    charge(accounting, admission, rec, generated)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def counter(data: MemoryData, partition: str, row: str) -> dict[str, Any]:
    """A counter row as the store holds it ({} when there is none)."""
    found = data.tables.get(LIMITS_TABLE, {}).get(partition, {}).get(row)
    return dict(found[0]) if found else {}


async def until(check: Callable[[], bool], within: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.01)
