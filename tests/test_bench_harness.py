"""tools/bench's own logic, without the benchmark's servers: the load client's reader on another
instance (the resume path: it follows the writer's x-stream-id and its lag is summarised) and the
Targets rows against the floor (issue #24: ratios and differences, met or not)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

import loadgen
import report

EVENTS = [b'data: {"delta":"ab"}\n\n'] * 5 + [b"event: done\ndata: {}\n\n"]


async def _handler(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    line = head.split(b"\r\n", 1)[0].decode()
    if line.startswith("POST"):
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-stream-id: abc123\r\n\r\n")
    else:
        assert line.split()[1] == "/api/streams/abc123", line
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    for event in EVENTS:
        writer.write(event)
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.close()


async def _wave() -> dict:
    server = await asyncio.start_server(_handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    where = {"host": "127.0.0.1", "port": port, "hostport": f"127.0.0.1:{port}"}
    target = {"kind": "app", "path": "/api/chat", **where, "follow": {**where, "path": "/api/streams/{id}", "every": 2}}
    items = [[0, "m0", 0], [1, "m1", 0]]
    try:
        return await loadgen.run_wave({"target": target, "items": items, "expected": 5, "expected_chars": 10})
    finally:
        server.close()


def test_a_follower_reads_the_stream_the_writer_was_told_about_and_its_lag_is_summarised():
    result = asyncio.run(_wave())
    first, second = result["records"]
    assert first["ok"] and second["ok"] and first["stream_id"] == "abc123"
    assert first["follower"]["error"] is None and len(first["follower"]["d"]) == 5
    assert "follower" not in second  # one stream in `every` is followed
    summary = report._follower(result["records"])
    assert summary["readers"] == 1 and summary["lag_n"] >= 4 and summary["lag"][50] is not None


def _row(added50, added99, cpu_stream):
    return {
        "added_ttfd": {50: added50, 95: None, 99: added99},
        "cpu_per_stream_ms": cpu_stream,
        "errors": 0,
        "completed": 10,
        "streams": 10,
        "peak_rss_mb": 300.0,
    }


def test_targets_judge_the_app_by_its_ratio_to_the_floor():
    rows = {
        1: {"app": _row(7.0, 9.0, None), "floor": _row(6.0, 8.0, None)},
        100: {"app": _row(120.0, 260.0, 12.0), "floor": _row(100.0, 200.0, 10.0)},
        300: {"app": _row(500.0, 900.0, 13.0), "floor": _row(400.0, 800.0, 10.0)},
        1000: {"app2": _row(1000.0, 2000.0, 9.0), "floor2": _row(900.0, 1800.0, 8.0)},
    }
    split = {
        p: {"level": 100, "worker": {"per_request_ms": 3.0, "per_delta_ms": d}}
        for p, d in (("app", 0.13), ("floor", 0.12))
    }
    got = {t["key"]: t for t in report.targets({"rows": rows, "cpu_split": split})}
    assert got["cpu_stream_100"]["met"] and not got["cpu_stream_300"]["met"]  # 1.2× and 1.3×
    assert got["ttfd_100_p50"]["met"] and got["ttfd_100_p99"]["met"] is True  # 1.2× and 1.3×
    assert got["ttfd_300_p99"]["rel_text"] == "1.12×" and got["worker_delta"]["met"]
    assert got["single_p50"]["rel_text"] == "+1.00 ms" and got["single_p50"]["met"]
    assert got["big_complete"]["met"] and got["big_p99"]["met"] and got["big_rss"]["met"]


def test_issue_34s_rows_are_all_there_and_say_not_measured_where_the_run_lacks_them():
    rows = {
        1: {p: {**_row(v, v, None), "peak_rss_mb": m} for p, v, m in (("app", 6.0, 170.0), ("keys", 7.0, 200.0))}
        | {"keyslim": _row(6.5, 9.0, None), "keyteam": _row(6.4, 9.0, None)},
        100: {"app": _row(200.0, 600.0, 14.0), "keys": _row(220.0, 630.0, 17.0), "keyslim": _row(230.0, 700.0, 17.0)},
    }
    split = {
        p: {"level": 100, "worker": {"per_request_ms": r, "per_delta_ms": 0.1}}
        for p, r in (("app", 4.0), ("keys", 4.8), ("keyslim", 5.0), ("keyteam", 5.5))
    }
    s = {"rows": rows, "cpu_split": split, "paths": ["app", "keys", "keyslim", "keyteam"]}
    got = report.targets34(s)
    assert len(got) == 10 and got[0]["target"] == "worker CPU per request, keyed (`CALLER_KEYS=required`)"
    by = {t["key"]: t for t in got}
    assert by["keyed_request"]["met"] and "+0.80 ms" in by["keyed_request"]["measured"]
    assert by["keyed_p99"]["met"] and by["keyed_p99"]["measured"].startswith("1.05×")  # 630 / 600
    assert by["keyed_limit_p50"]["met"] and by["keyed_memory"]["met"]  # +0.5 ms; +30 MB
    for key in ("resume_cpu_stream", "reader_lag_p99", "cpu_vs_floor", "p99_vs_floor", "resume_p50", "cold_start"):
        assert by[key]["measured"] == report.NOT_MEASURED and by[key]["met"] is None, key
    team = {t["key"]: t for t in report.team_targets(s)}
    assert team["keyteam_p50"]["met"] and team["keyteam_p50"]["measured"].endswith("(-0.10 ms)")
    assert not team["keyteam_request"]["met"]  # 5.5 against 5.0 ms
    assert team["keyteam_p99"]["measured"] == report.NOT_MEASURED and team["keyteam_p99"]["met"] is None
