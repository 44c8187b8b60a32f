"""chatstream/telemetry.py: the ``chat.stream`` span and the stream metrics, read back from the
OpenTelemetry SDK's in-memory span exporter and metric reader installed as the global providers.

Two layers:
- ``telemetry`` driven directly with ``record.StreamRecord``s (what ``endpoint._Ending.finish`` hands it);
- end to end: the app's real /api/chat endpoint served by uvicorn on 127.0.0.1 in this process (the exporter
  has to live in the app's process), talking to the real scripted upstream (``fakeupstream``, a
  subprocess), called over HTTP, including a caller that hangs up mid-stream.

Each test uses a model name of its own, so spans and metric points of other tests never mix in."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from helpers import InProcessApp
from httpx_sse import EventSource
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from servers import ROOT

from chatstream import telemetry
from chatstream.record import StreamRecord

SPANS = InMemorySpanExporter()
READER = InMemoryMetricReader()


def _install_providers() -> None:
    """Install SDK providers once per process (OpenTelemetry allows setting them only once)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider) and getattr(
        trace.get_tracer_provider(), "_chatstream_test", False
    ):
        return
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(SPANS))
    tracer_provider._chatstream_test = True
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))
    if not getattr(trace.get_tracer_provider(), "_chatstream_test", False):
        pytest.skip("another OpenTelemetry tracer provider is already installed in this process")


@pytest.fixture
def otel():
    _install_providers()
    return SPANS, READER


@pytest.fixture
def model() -> str:
    return f"test-model-{uuid.uuid4().hex[:8]}"


def spans_of(model: str) -> list:
    return [s for s in SPANS.get_finished_spans() if s.attributes.get("gen_ai.request.model") == model]


def points_of(model: str) -> dict[str, list]:
    """Metric name -> data points whose ``model`` attribute is ``model`` (cumulative values)."""
    found: dict[str, list] = {}
    data = READER.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if point.attributes.get("model") == model:
                        found.setdefault(metric.name, []).append(point)
    return found


def counter_value(points: list, **attrs) -> int:
    matching = [p for p in points if all(p.attributes.get(k) == v for k, v in attrs.items())]
    assert all(isinstance(p, NumberDataPoint) for p in matching)
    return sum(p.value for p in matching)


def finished_record(model: str, *, ttfd: float = 0.05, deltas: int = 3) -> StreamRecord:
    record = StreamRecord(endpoint="chat", model=model, model_accepted=True)
    record.first_delta_at = record.started + ttfd
    record.deltas = deltas
    record.finish_reason = "stop"
    record.usage = {"prompt_tokens": 9, "completion_tokens": deltas, "total_tokens": 9 + deltas}
    return record


def ended(record: StreamRecord) -> None:
    """A request's whole span at once: ``begin`` then ``finish``."""
    telemetry.begin(record)
    telemetry.finish(record)


# ---------------------------------------------------------------------------------------------
# The module on its own
# ---------------------------------------------------------------------------------------------


def test_completed_stream_gives_one_span_with_gen_ai_attributes(otel, model):
    record = finished_record(model)
    telemetry.begin(record)
    time.sleep(0.12)
    telemetry.finish(record)

    (span,) = spans_of(model)
    assert span.name == "chat.stream"
    assert span.kind is SpanKind.INTERNAL
    assert span.status.status_code is StatusCode.UNSET
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["chat.endpoint"] == "chat"
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["gen_ai.usage.input_tokens"] == 9
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["http.response.status_code"] == a["chat.status"] == 200
    assert a["chat.finish_reason"] == "stop"
    assert a["chat.deltas"] == 3
    assert a["chat.disconnected"] is False
    assert a["chat.outcome"] == "completed"
    assert a["chat.time_to_first_delta_ms"] == pytest.approx(50.0, abs=0.11)
    assert a["chat.duration_ms"] >= 120
    assert "error.type" not in a and "chat.error" not in a
    # The span lasts from begin to finish: the stream's duration.
    assert (span.end_time - span.start_time) / 1e6 == pytest.approx(a["chat.duration_ms"], abs=20)


def test_a_callers_request_names_the_caller_and_the_request_id(otel, model):
    record = finished_record(model)
    record.caller, record.request_id = "team-a", "req_42"
    ended(record)
    (span,) = spans_of(model)
    assert span.attributes["chat.caller"] == "team-a" and span.attributes["chat.request_id"] == "req_42"
    tokens = points_of(model)["chat.stream.tokens"]
    assert counter_value(tokens, caller="team-a", **{"gen_ai.token.type": "input"}) == 9
    (duration,) = points_of(model)["chat.stream.duration"]
    assert duration.attributes["caller"] == "team-a"


def test_a_teams_request_carries_its_team_and_cost(otel, model):
    record = finished_record(model)
    record.caller, record.team, record.cost = "search-prod", "search", 313_200_000  # pico-USD
    ended(record)
    (span,) = spans_of(model)
    assert span.attributes["chat.team"] == "search" and span.attributes["chat.cost_usd"] == pytest.approx(0.0003132)
    points = points_of(model)
    assert counter_value(points["chat.stream.tokens"], team="search", **{"gen_ai.token.type": "input"}) == 9
    (cost,) = points["chat.stream.cost"]
    assert cost.attributes["team"] == "search" and cost.value == pytest.approx(0.0003132)


def test_completed_stream_records_metrics(otel, model):
    ended(finished_record(model, ttfd=0.25, deltas=4))

    points = points_of(model)
    (ttfd,) = points["chat.stream.time_to_first_delta"]
    assert isinstance(ttfd, HistogramDataPoint)
    assert ttfd.count == 1 and ttfd.sum == pytest.approx(250.0, abs=0.11)
    (duration,) = points["chat.stream.duration"]
    assert duration.count == 1 and duration.sum >= 0
    assert duration.attributes == {"model": model, "endpoint": "chat", "status": 200, "outcome": "completed"}
    assert counter_value(points["chat.stream.deltas"]) == 4
    assert counter_value(points["chat.stream.tokens"], **{"gen_ai.token.type": "input"}) == 9
    assert counter_value(points["chat.stream.tokens"], **{"gen_ai.token.type": "output"}) == 4


def test_refused_models_are_not_metric_dimensions(otel, model):
    """A caller chooses the model name: one the app refused (ALLOWED_MODELS, or the upstream said it
    does not exist) must not create a metric series of its own (hardening item 9)."""
    record = finished_record(model)
    record.model_accepted = False
    ended(record)
    assert points_of(model) == {}, "a refused model name became a metric dimension"
    assert points_of(telemetry.OTHER_MODEL)["chat.stream.duration"]
    (span,) = spans_of(model)  # the span still says what was asked (bounded in length)
    assert span.attributes["gen_ai.request.model"] == model


def test_metrics_add_up_over_streams(otel, model):
    for ttfd in (0.1, 0.3):
        ended(finished_record(model, ttfd=ttfd, deltas=2))
    points = points_of(model)
    (ttfd,) = points["chat.stream.time_to_first_delta"]
    assert ttfd.count == 2 and ttfd.sum == pytest.approx(400.0, abs=0.2)
    assert ttfd.min == pytest.approx(100.0, abs=0.11) and ttfd.max == pytest.approx(300.0, abs=0.11)
    assert counter_value(points["chat.stream.deltas"]) == 4


def test_caller_hanging_up_is_marked_disconnected_not_failed(otel, model):
    record = StreamRecord(endpoint="chat", model=model, model_accepted=True)
    telemetry.begin(record)
    record.first_delta_at = record.started + 0.01
    record.deltas = 2
    record.disconnected = True
    telemetry.finish(record)

    (span,) = spans_of(model)
    assert span.attributes["chat.disconnected"] is True
    assert span.attributes["chat.outcome"] == "disconnected"
    assert "gen_ai.response.finish_reasons" not in span.attributes
    assert "gen_ai.usage.output_tokens" not in span.attributes
    assert span.status.status_code is StatusCode.UNSET
    (duration,) = points_of(model)["chat.stream.duration"]
    assert duration.attributes["outcome"] == "disconnected"


def test_hang_up_before_the_first_token(otel, model):
    record = StreamRecord(endpoint="chat", model=model, model_accepted=True)
    record.status, record.disconnected = 499, True
    ended(record)
    (span,) = spans_of(model)
    assert span.attributes["http.response.status_code"] == 499
    assert span.attributes["chat.disconnected"] is True
    assert "chat.time_to_first_delta_ms" not in span.attributes
    assert "chat.stream.time_to_first_delta" not in points_of(model)


@pytest.mark.parametrize(
    "status,error,failed",
    [
        (200, "upstream_timeout", True),  # failed after the headers: the final error event
        (502, "upstream_error", True),
        (429, "rate_limited", True),
        (400, "invalid_request", False),  # the caller's mistake, not ours
        (503, "not_configured", True),
    ],
)
def test_errors(otel, model, status, error, failed):
    record = StreamRecord(endpoint="chat", model=model, model_accepted=True)
    record.status, record.error = status, error
    ended(record)
    (span,) = spans_of(model)
    assert span.attributes["error.type"] == span.attributes["chat.error"] == error
    assert span.attributes["chat.status"] == status
    assert span.attributes["chat.outcome"] == "failed"
    assert span.status.status_code is (StatusCode.ERROR if failed else StatusCode.UNSET)


def test_model_named_by_the_request_replaces_the_default(otel, model):
    record = finished_record("the-default-model")
    telemetry.begin(record)
    record.model = model
    telemetry.finish(record)
    (span,) = spans_of(model)
    assert span.attributes["gen_ai.request.model"] == model


def test_finish_counts_once(otel, model):
    record = finished_record(model)
    telemetry.begin(record)
    telemetry.finish(record)
    telemetry.finish(record)
    assert len(spans_of(model)) == 1
    assert counter_value(points_of(model)["chat.stream.deltas"]) == 3


def test_begin_and_finish_keep_the_handle_for_the_app(otel, model):
    record = StreamRecord(endpoint="openai", model=model, model_accepted=True)
    telemetry.begin(record)
    record.deltas, record.finish_reason = 2, "stop"
    telemetry.finish(record)
    telemetry.finish(record)  # a second call is ignored
    (span,) = spans_of(model)
    assert span.attributes["chat.endpoint"] == "openai"
    assert points_of(model)["chat.stream.deltas"][0].attributes == {"model": model, "endpoint": "openai"}


def test_finish_without_begin_is_ignored(otel, model):
    telemetry.finish(finished_record(model))
    assert spans_of(model) == []


def test_broken_record_still_ends_the_span_and_never_raises(otel, model, caplog):
    class Broken(StreamRecord):
        def ttfd_ms(self):
            raise RuntimeError("boom")

    record = Broken(endpoint="chat", model=model)
    telemetry.begin(record)
    telemetry.finish(record)  # must not raise
    (span,) = spans_of(model)
    assert span.end_time is not None
    assert "chat stream telemetry failed" in caplog.text


def test_odd_usage_shapes(otel, model):
    record = finished_record(model)
    record.usage = {"prompt_tokens": True, "completion_tokens": "7"}
    ended(record)
    (span,) = spans_of(model)
    assert "gen_ai.usage.input_tokens" not in span.attributes
    assert "gen_ai.usage.output_tokens" not in span.attributes


def test_what_application_insights_receives(otel, model):
    """The installed azure-monitor exporter's own conversion (private functions, so skipped if they
    move): the span becomes a dependency named chat.stream of type InProc whose customDimensions hold
    the attributes docs/observability.md queries; a histogram becomes one customMetrics row per
    interval with sum, count, min and max, and no buckets (so percentiles come from the span)."""
    trace_exporter = pytest.importorskip("azure.monitor.opentelemetry.exporter.export.trace._exporter")
    metric_exporter = pytest.importorskip("azure.monitor.opentelemetry.exporter.export.metrics._exporter")
    to_dependency = getattr(trace_exporter, "_convert_span_to_envelope", None)
    to_metric = getattr(metric_exporter, "_convert_point_to_envelope", None)
    if to_dependency is None or to_metric is None:
        pytest.skip("the exporter's private conversion functions moved")
    ended(finished_record(model, ttfd=0.05))

    (span,) = spans_of(model)
    envelope = to_dependency(span)
    data = envelope.data.base_data
    assert envelope.data.base_type == "RemoteDependencyData"
    assert (data.name, data.type, data.success) == ("chat.stream", "InProc", True)
    dims = data.properties
    assert dims["gen_ai.request.model"] == model
    assert dims["chat.time_to_first_delta_ms"] == "50.0"
    assert dims["chat.status"] == "200" and dims["chat.finish_reason"] == "stop"
    assert dims["gen_ai.usage.output_tokens"] == "3" and dims["chat.disconnected"] == "False"

    data = READER.get_metrics_data()
    rows = {}
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if point.attributes.get("model") == model:
                        envelope = to_metric(point, metric.name, resource_metrics.resource, scope.scope)
                        rows[metric.name] = (envelope.data.base_data.metrics[0], envelope.data.base_data.properties)
    row, dims = rows["chat.stream.time_to_first_delta"]
    assert (row.name, row.value, row.count, row.min, row.max) == (
        "chat.stream.time_to_first_delta",
        50.0,
        1,
        50.0,
        50.0,
    )
    assert dims == {"model": model, "endpoint": "chat"}


def test_no_sdk_means_no_cost_and_no_error():
    """Without any provider installed (a fresh process) the calls are harmless no-ops, and importing
    the module pulls in neither the SDK nor azure monitor."""
    code = (
        "import sys\n"
        "from chatstream import telemetry\n"
        "from chatstream.record import StreamRecord\n"
        "assert 'azure.monitor.opentelemetry' not in sys.modules\n"
        "assert 'opentelemetry.sdk' not in sys.modules\n"
        "assert telemetry.configure({}) == 'off'\n"
        "r = StreamRecord(endpoint='chat', model='m'); telemetry.begin(r); r.deltas = 1; telemetry.finish(r)\n"
        "assert 'azure.monitor.opentelemetry' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# configure()
# ---------------------------------------------------------------------------------------------

CONNECTION = "InstrumentationKey=00000000-0000-0000-0000-000000000000;IngestionEndpoint=https://example.invalid/"


@pytest.fixture
def fake_azure_monitor(monkeypatch):
    """A stand-in azure.monitor.opentelemetry that records calls (the real one would install
    global providers and start exporting)."""
    import types

    calls = []
    module = types.ModuleType("azure.monitor.opentelemetry")
    module.configure_azure_monitor = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "azure.monitor.opentelemetry", module)
    monkeypatch.setattr(telemetry, "_configured_by_app", False)
    return calls


def test_configure_off_without_connection_string(fake_azure_monitor):
    assert telemetry.configure({}) == "off"
    assert telemetry.configure({"APPLICATIONINSIGHTS_CONNECTION_STRING": "  "}) == "off"
    assert fake_azure_monitor == []


def test_configure_leaves_it_to_the_worker(fake_azure_monitor):
    env = {"APPLICATIONINSIGHTS_CONNECTION_STRING": CONNECTION, "PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY": "true"}
    assert telemetry.configure(env) == "worker"
    assert fake_azure_monitor == []


def test_configure_sets_up_azure_monitor_once(fake_azure_monitor):
    env = {"APPLICATIONINSIGHTS_CONNECTION_STRING": CONNECTION}
    assert telemetry.configure(env) == "app"
    assert telemetry.configure(env) == "app"
    assert fake_azure_monitor == [{"connection_string": CONNECTION}]


def test_configure_failure_does_not_stop_the_app_or_leak_the_string(fake_azure_monitor, monkeypatch, caplog):
    def fail(**kwargs):
        raise ValueError(f"bad connection string {CONNECTION}")

    monkeypatch.setattr(sys.modules["azure.monitor.opentelemetry"], "configure_azure_monitor", fail)
    assert telemetry.configure({"APPLICATIONINSIGHTS_CONNECTION_STRING": CONNECTION}) == "off"
    assert "ValueError" in caplog.text and "InstrumentationKey" not in caplog.text


def test_configure_without_the_package(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "azure.monitor.opentelemetry", None)  # import fails
    monkeypatch.setattr(telemetry, "_configured_by_app", False)
    assert telemetry.configure({"APPLICATIONINSIGHTS_CONNECTION_STRING": CONNECTION}) == "off"
    assert "not installed" in caplog.text


def test_the_real_azure_monitor_distro_accepts_the_call():
    """configure_azure_monitor exists with the keyword arguments the worker and we rely on."""
    import inspect

    from azure.monitor.opentelemetry import configure_azure_monitor

    doc = inspect.getdoc(configure_azure_monitor) or ""
    for keyword in ("connection_string", "credential", "logger_name"):
        assert keyword in doc


# ---------------------------------------------------------------------------------------------
# End to end: the real endpoint over HTTP, in this process
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inproc(upstream):
    app = InProcessApp(upstream.base_url)
    yield app
    app.stop()


def wait_for_span(model: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        found = spans_of(model)
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"expected one chat.stream span for {model}, got {len(found)}"
            return found[0]
        time.sleep(0.02)


def test_streamed_request_end_to_end(otel, model, inproc):
    body = {"prompt": "[scenario:normal] tell me something", "model": model}
    events = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", inproc.chat_url, json=body) as response:
            assert response.status_code == 200
            for sse in EventSource(response).iter_sse():
                events.append((sse.event, json.loads(sse.data)))
    deltas = [d for e, d in events if e == "message"]
    (done,) = [d for e, d in events if e == "done"]

    span = wait_for_span(model)
    a = span.attributes
    assert a["chat.deltas"] == len(deltas) == 10
    assert a["gen_ai.response.finish_reasons"] == (done["finish_reason"],)
    assert a["gen_ai.usage.input_tokens"] == done["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == done["usage"]["completion_tokens"]
    assert a["chat.disconnected"] is False and a["chat.outcome"] == "completed"
    assert a["http.response.status_code"] == 200
    assert 0 < a["chat.time_to_first_delta_ms"] < a["chat.duration_ms"]
    # The normal scenario spreads 10 deltas 10 ms apart: the span covers the whole stream.
    assert (span.end_time - span.start_time) / 1e6 >= 90
    # Nothing of the conversation is recorded.
    assert not any("tell me" in str(v) or "Hello" in str(v) for v in a.values())

    points = points_of(model)
    (ttfd,) = points["chat.stream.time_to_first_delta"]
    assert ttfd.count == 1 and ttfd.sum == pytest.approx(a["chat.time_to_first_delta_ms"], abs=0.2)
    assert counter_value(points["chat.stream.deltas"]) == 10
    assert (
        counter_value(points["chat.stream.tokens"], **{"gen_ai.token.type": "output"})
        == done["usage"]["completion_tokens"]
    )


def test_caller_hanging_up_end_to_end(otel, model, inproc):
    body = {"prompt": "[scenario:stall] wait", "model": model}
    got = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", inproc.chat_url, json=body) as response:
            assert response.status_code == 200
            for sse in EventSource(response).iter_sse():
                got.append(sse.event)
                break  # hang up after the first delta: the upstream then stalls forever
    assert got == ["message"]

    span = wait_for_span(model)
    assert span.attributes["chat.disconnected"] is True
    assert span.attributes["chat.outcome"] == "disconnected"
    assert span.attributes["chat.deltas"] >= 1
    assert span.status.status_code is StatusCode.UNSET
    (duration,) = points_of(model)["chat.stream.duration"]
    assert duration.attributes["outcome"] == "disconnected"


def test_rejected_request_end_to_end(otel, model, inproc):
    response = httpx.post(inproc.chat_url, json={"prompt": "[scenario:rate_limited] hi", "model": model}, timeout=30)
    assert response.status_code == 429
    span = wait_for_span(model)
    assert span.attributes["error.type"] == "rate_limited"
    assert span.status.status_code is StatusCode.ERROR


def test_the_span_has_the_request_id_the_caller_got(otel, model, inproc, upstream):
    """Issue #23 item 9: ``x-request-id`` (the upstream's when it sent one, else the app's own) is on
    the answer, in the log line and on the span, so a caller's report can be found."""
    streamed = httpx.post(inproc.chat_url, json={"prompt": "[scenario:normal] hi", "model": model}, timeout=30)
    assert streamed.status_code == 200
    assert streamed.headers["x-request-id"] == upstream.requests(last=1)[-1]["id"]
    assert wait_for_span(model).attributes["chat.request_id"] == streamed.headers["x-request-id"]

    upstream_refused = httpx.post(inproc.chat_url, json={"prompt": "[scenario:bad_request] hi"}, timeout=30)
    assert upstream_refused.status_code == 400
    assert upstream_refused.headers["x-request-id"] == upstream.requests(last=1)[-1]["id"], "the upstream's"
    refused = httpx.post(inproc.chat_url, json={"prompt": ""}, timeout=30)
    assert refused.status_code == 400 and len(refused.headers["x-request-id"]) == 32  # the app's own
    for answer in (upstream_refused, refused):
        request_id = answer.headers["x-request-id"]
        deadline = time.monotonic() + 5
        while not [s for s in SPANS.get_finished_spans() if s.attributes.get("chat.request_id") == request_id]:
            assert time.monotonic() < deadline, f"no span with chat.request_id {request_id}"
            time.sleep(0.02)


def test_each_pool_entrys_next_probe_is_a_gauge(otel):
    """Issue 42: the state of each entry's breaker and the seconds to its next probe, as metrics."""
    from chatstream.upstreams.config import Entry
    from chatstream.upstreams.health import Policy
    from chatstream.upstreams.outcomes import Outcome, OutcomeKind
    from chatstream.upstreams.pool import Pool

    now = [100.0]
    names = [f"probe-{uuid.uuid4().hex[:6]}-{n}" for n in ("a", "b")]
    pool = Pool(
        [Entry(name=n, kind="openai", url=f"http://{n}.test/v1", priority=i) for i, n in enumerate(names)],
        policy=Policy(backoff_initial=4.0, backoff_max=8.0),
        now=lambda: now[0],
    )
    attempt = pool.acquire(pool.entries[0], "m")
    assert attempt is not None
    attempt.report(Outcome(OutcomeKind.CONNECT_FAILED))  # opens at once, for 4 s
    telemetry.watch_probes(pool.probes)

    def gauge() -> dict[str, tuple[str, float]]:
        found = {}
        data = READER.get_metrics_data()
        for resource_metrics in data.resource_metrics if data else ():
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == telemetry.METRIC_UPSTREAM_NEXT_PROBE:
                        for point in metric.data.data_points:
                            if point.attributes["upstream"] in names:
                                found[point.attributes["upstream"]] = (point.attributes["breaker"], point.value)
        return found

    now[0] += 1.5
    assert gauge() == {names[0]: ("open", 2.5), names[1]: ("closed", 0.0)}
    now[0] += 3
    assert gauge()[names[0]] == ("half_open", 0.0)
