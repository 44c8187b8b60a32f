"""OpenTelemetry for chat streams: one span and a few metrics per request, and the pool's counters.

The app calls this module in three places::

    telemetry.configure()          # once, at start-up (function_app.py): export, when asked for
    telemetry.begin(record)        # when a request starts (Endpoint.__call__, after its StreamRecord)
    telemetry.finish(record)       # when its stream is over (endpoint._Ending.finish)

``record`` is the request's ``record.StreamRecord``. The span ``chat.stream`` starts in ``begin`` and
ends in ``finish``, so its duration is the stream's; ``finish`` also records the metrics. The span
is not made current (the stream outlives the code that starts it, and the relay runs in other
tasks); it takes the current context as parent, so when the worker has attached the host's trace
context the span belongs to the invocation's operation. Spans and metrics go to the global
OpenTelemetry providers (``trace.get_tracer`` / ``metrics.get_meter``): with no SDK configured those
are no-ops, so the calls cost next to nothing. The pool counts through ``upstream_event`` and
``watch_probes``.

Telemetry never breaks a request: errors here are logged and swallowed. Prompts, completions and
keys are never recorded. docs/observability.md lists what is emitted and how to query it."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .record import StreamRecord

log = logging.getLogger("chatstream")

# Every name below is listed, with what it means and its dimensions, in docs/observability.md.
METRIC_UPSTREAM_NEXT_PROBE = "chat.upstream.next_probe"
# The per-entry counters ``upstream_event`` adds to (dimension ``upstream``: entry names come from
# UPSTREAMS, so they are bounded): name -> (unit, description).
_UPSTREAM_COUNTERS = {
    "requests": ("{request}", "Attempts sent to each upstream entry"),
    "failovers": ("{request}", "Attempts that moved the request to the next entry (dimension reason: the outcome)"),
    "cooldowns": ("{cooldown}", "429s that made an entry cool down"),
    "breaker": ("{change}", "An entry's breaker opening or closing (dimension state: open or closed; reason)"),
    "continuations": (
        "{answer}",
        "Answers that failed mid-answer on an entry and went on on another stream (dimension reason)",
    ),
}

# Histogram buckets (ms) for exporters that keep buckets (Application Insights keeps only
# count/sum/min/max per interval): first tokens take 100 ms to minutes, streams up to 30 min.
_MS_BUCKETS = (25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000)
_MAX_MODEL_CHARS = 128
# The metric dimension for models the app refused: a caller picks the model name, and attribute
# values must stay bounded.
OTHER_MODEL = "(other)"

ENV_CONNECTION_STRING = "APPLICATIONINSIGHTS_CONNECTION_STRING"

_configured_by_app = False


def configure(environ: Mapping[str, str] = os.environ) -> str:
    """Set up export to Application Insights if asked to. Returns how telemetry leaves the process:

    - ``"off"``: no ``APPLICATIONINSIGHTS_CONNECTION_STRING``; nothing is imported or exported;
    - ``"worker"``: ``PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY`` is true (what infra/ deploys), so
      the Functions Python worker has called ``configure_azure_monitor`` before loading the app;
      doing it again would export everything twice;
    - ``"app"``: this call ran ``configure_azure_monitor()`` with the connection string (for Entra
      ingestion the exporter reads ``APPLICATIONINSIGHTS_AUTHENTICATION_STRING`` itself); the azure
      monitor package is imported only then, never at import time."""
    global _configured_by_app
    if not (environ.get(ENV_CONNECTION_STRING) or "").strip():
        return "off"
    if (environ.get("PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY") or "").strip().lower() in ("1", "true", "yes"):
        return "worker"
    if _configured_by_app:
        return "app"
    try:
        from azure.monitor.opentelemetry import configure_azure_monitor
    except ImportError:
        log.warning(
            "%s is set but azure-monitor-opentelemetry is not installed: no telemetry export", ENV_CONNECTION_STRING
        )
        return "off"
    try:
        configure_azure_monitor(connection_string=environ[ENV_CONNECTION_STRING].strip())
    except Exception as exc:  # noqa: BLE001 - telemetry must never stop the app; never log the message: it may quote the connection string
        log.warning("could not configure Azure Monitor export (%s): no telemetry export", type(exc).__name__)
        return "off"
    _configured_by_app = True
    return "app"


def _histogram(meter, name: str, description: str):
    return meter.create_histogram(
        name, unit="ms", description=description, explicit_bucket_boundaries_advisory=_MS_BUCKETS
    )  # bucket advice: opentelemetry-api 1.23 on (requirements.txt)


class _Instruments:
    def __init__(self) -> None:
        meter = metrics.get_meter(__name__)
        self.ttfd = _histogram(
            meter, "chat.stream.time_to_first_delta", "Time from the request to the first delta sent"
        )
        self.duration = _histogram(meter, "chat.stream.duration", "Time from the request to the end of its stream")
        self.deltas = meter.create_counter(
            "chat.stream.deltas", unit="{delta}", description="Content deltas sent to callers"
        )
        # USD, by model, endpoint, caller and team (CALLER_KEYS=required, priced models).
        self.cost = meter.create_counter(
            "chat.stream.cost", unit="USD", description="What requests cost at the model's price"
        )
        self.tokens = meter.create_counter(
            "chat.stream.tokens",
            unit="{token}",
            description="Tokens the upstream reported (gen_ai.token.type input/output)",
        )
        self.upstream = {
            name: meter.create_counter(f"chat.upstream.{name}", unit=unit, description=description)
            for name, (unit, description) in _UPSTREAM_COUNTERS.items()
        }


_instruments = functools.cache(_Instruments)  # made on first use

# A proxy until an SDK provider is installed (by the worker, configure(), or a test); then it
# delegates to that provider.
_tracer = trace.get_tracer(__name__)


def begin(record: StreamRecord) -> None:
    """Start the ``chat.stream`` span of the request ``record`` (a fresh one) describes; the span
    travels on the record until ``finish``."""
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": _model(record.model)}
    if record.endpoint:
        attributes["chat.endpoint"] = record.endpoint
    try:
        record.telemetry = _tracer.start_span("chat.stream", kind=SpanKind.INTERNAL, attributes=attributes)
    except Exception:
        log.warning("chat stream span did not start", exc_info=True)


def finish(record: StreamRecord) -> None:
    """End the span started by ``begin(record)`` and record the metrics. Only the first call counts;
    a record that never went through ``begin`` is ignored."""
    span, record.telemetry = record.telemetry, None
    if span is None:
        return
    end_ns = time.time_ns()
    try:
        _record_stream(span, record)
    except Exception:
        log.warning("chat stream telemetry failed", exc_info=True)
    finally:
        try:
            span.end(end_time=end_ns)
        except Exception:
            log.warning("chat stream span did not end", exc_info=True)


_watched: list[weakref.WeakMethod] = []
_probe_gauge = None


def watch_probes(probes: Callable[[], Iterable[tuple[str, float | None]]]) -> None:
    """Report ``probes()`` (a pool's ``Pool.probes``: entry, seconds to its next probe or None when
    closed) as the gauge ``chat.upstream.next_probe``, dimensions ``upstream`` and ``breaker``
    (``closed``, ``open``, ``half_open``; closed entries report 0). Read on the exporter's thread;
    a pool no longer referenced stops being reported."""
    global _probe_gauge
    try:
        _watched.append(weakref.WeakMethod(probes))
        if _probe_gauge is None:
            _probe_gauge = metrics.get_meter(__name__).create_observable_gauge(
                METRIC_UPSTREAM_NEXT_PROBE,
                callbacks=[_observe_probes],
                unit="s",
                description="Seconds until a request may probe each pool entry's open breaker (dimension breaker)",
            )
    except Exception:
        log.warning("upstream telemetry failed", exc_info=True)


def _observe_probes(options: object) -> Iterable[metrics.Observation]:
    observations = []
    for ref in list(_watched):
        probes = ref()
        if probes is None:
            _watched.remove(ref)
            continue
        try:
            for name, seconds in probes():
                breaker = "closed" if seconds is None else "open" if seconds > 0 else "half_open"
                observations.append(metrics.Observation(seconds or 0.0, {"upstream": name, "breaker": breaker}))
        except Exception:
            log.warning("upstream telemetry failed", exc_info=True)
    return observations


def upstream_event(metric: str, upstream: str, **dimensions: str) -> None:
    """Count one attempt (``requests``), failover (``failovers``), cooldown (``cooldowns``) or
    continuation elsewhere after a failure mid-answer (``continuations``) of the pool entry
    ``upstream``."""
    try:
        _instruments().upstream[metric].add(1, {"upstream": upstream, **dimensions})
    except Exception:
        log.warning("upstream telemetry failed", exc_info=True)


def _model(model: str | None) -> str:
    return (model or "")[:_MAX_MODEL_CHARS]


def _tokens(usage: Mapping | None) -> tuple[int | None, int | None]:
    if not isinstance(usage, Mapping):
        return None, None

    def count(*names: str) -> int | None:
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    return count("prompt_tokens", "input_tokens"), count("completion_tokens", "output_tokens")


def _record_stream(span, record: StreamRecord) -> None:
    """The span's attributes and status, and the stream's metrics, from one reading of ``record``.
    The span carries the gen_ai.* semantic conventions' attributes, and ours (``chat.*``):
    Application Insights drops http.* and error.type from a dependency's customDimensions, and
    stores the finish reasons array as text: ``chat.status``, ``chat.error`` and
    ``chat.finish_reason`` carry the same facts in a form Kusto reads easily."""
    ttfd_ms, duration_ms = record.ttfd_ms(), record.duration_ms()
    # The caller hung up first, an error ended it (before or after the headers), or neither.
    ended = "disconnected" if record.disconnected else "failed" if record.error else "completed"
    input_tokens, output_tokens = _tokens(record.usage)
    if span.is_recording():  # else (no tracing configured, or the span sampled out) nothing would keep them
        attributes: dict[str, str | int | float | bool | tuple[str, ...]] = {
            "gen_ai.request.model": _model(record.model),
            "http.response.status_code": record.status,
            "chat.status": record.status,
            "chat.deltas": record.deltas,
            "chat.disconnected": bool(record.disconnected),
            "chat.outcome": ended,
            "chat.duration_ms": duration_ms,
        }  # and what ``begin`` set: the endpoint (the model again: a before-step may have chosen another)
        if record.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = (record.finish_reason,)
            attributes["chat.finish_reason"] = record.finish_reason
        if input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        if ttfd_ms is not None:
            attributes["chat.time_to_first_delta_ms"] = ttfd_ms
        if record.error:
            attributes["error.type"] = attributes["chat.error"] = record.error
        if record.upstream:  # the pool entry that served the request (or the last one tried), and how many were
            attributes["chat.upstream"] = record.upstream
            attributes["chat.attempts"] = record.attempts
        if record.continued:  # how often the answer went on on another stream, and those seams as JSON text
            attributes["chat.continuations"] = len(record.continued)
            attributes["chat.continued"] = json.dumps(record.continued)
        if record.caller:  # the caller key's name (CALLER_KEYS=required) and its team's: admin-made, so bounded
            attributes["chat.caller"] = record.caller
        if record.team:
            attributes["chat.team"] = record.team
        if record.cost is not None:  # what the request cost at the model's price (priced models only)
            attributes["chat.cost_usd"] = record.cost / 10**12
        if record.request_id:  # x-request-id: the upstream's, else the app's own
            attributes["chat.request_id"] = record.request_id
        span.set_attributes(attributes)
        # An error that is ours or the upstream's; not a request the caller got wrong (4xx other
        # than 429), nor a caller hanging up.
        if record.error and (record.status in (200, 429) or record.status >= 500):
            span.set_status(Status(StatusCode.ERROR, record.error))
    inst = _instruments()
    # A caller chooses the model name: only one the app (and its upstream) accepted may become a
    # metric dimension, or anyone could create unbounded series.
    by_model = {"model": _model(record.model) if record.model_accepted else OTHER_MODEL, "endpoint": record.endpoint}
    if record.caller:  # caller and team names are made by an admin: bounded dimensions
        by_model["caller"] = record.caller
    if record.team:
        by_model["team"] = record.team
    if record.cost:
        inst.cost.add(record.cost / 10**12, by_model)
    inst.duration.record(duration_ms, {**by_model, "status": record.status, "outcome": ended})
    if ttfd_ms is not None:
        inst.ttfd.record(ttfd_ms, by_model)
    if record.deltas:
        inst.deltas.add(record.deltas, by_model)
    if input_tokens:
        inst.tokens.add(input_tokens, {**by_model, "gen_ai.token.type": "input"})
    if output_tokens:
        inst.tokens.add(output_tokens, {**by_model, "gen_ai.token.type": "output"})
