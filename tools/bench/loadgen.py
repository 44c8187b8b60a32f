"""Load generator for the side-by-side benchmark (tools/bench/run.py drives it; see tools/bench/README.md).

One process runs waves of SSE streams and reports, per stream, when each content delta was parsed.
tools/bench/run.py keeps one or two of these processes alive (``--serve``: one JSON command per stdin
line, one JSON result per stdout line) and splits each wave between them.

Two engines, the same SSE parsing:
  * ``raw`` (default): asyncio Protocol over plain TCP, hand-rolled HTTP/1.1 (chunked) decoding; one
    connection per stream, no pool, so nothing caps the number of concurrent connections;
  * ``httpx``: httpx.AsyncClient with pool limits above the wave size (the cross-check; its own
    per-chunk overhead is larger, which is why ``raw`` is the default).

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux, the same clock in every process), in
ms after the request bytes were handed to the socket; ``sent_wall`` maps them to wall-clock time
(``time.time()``) so that they can be lined up with the scripted upstream's records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import resource
import sys
import time

OPENAI, APP = "openai", "app"


class SSE:
    """Incremental SSE parser: counts content deltas (and when they were parsed) and the end."""

    __slots__ = ("buf", "chars", "end", "error", "kind", "times")

    def __init__(self, kind: str):
        self.kind = kind
        self.buf = b""
        self.times: list[float] = []
        self.chars = 0
        self.end = False  # a proper last event: `data: [DONE]` (OpenAI) or `event: done` (app)
        self.error: str | None = None

    def feed(self, data: bytes, t: float) -> None:
        buf = self.buf + data if self.buf else data
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            if i < 0:
                break
            self._event(buf[start:i], t)
            start = i + 2
        self.buf = buf[start:]

    def _event(self, ev: bytes, t: float) -> None:
        name = None
        data = None
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                piece = line[5:].lstrip(b" ")
                data = piece if data is None else data + b"\n" + piece
            elif line.startswith(b"event:"):
                name = line[6:].strip()
        if data is None:
            return  # a comment (`: keep-alive`) or an empty event
        if self.kind == APP:
            if name is None:
                text = json.loads(data).get("delta")
                if text:
                    self.times.append(t)
                    self.chars += len(text)
            elif name == b"done":
                self.end = True
            elif name == b"error":
                self.error = "error_event"
            return
        if data == b"[DONE]":
            self.end = True
            return
        obj = json.loads(data)
        if "error" in obj:
            self.error = "error_event"
            return
        choices = obj.get("choices")
        if choices:
            delta = choices[0].get("delta") or {}
            text = delta.get("content")
            if text:
                self.times.append(t)
                self.chars += len(text)


class Stream(asyncio.Protocol):
    """One request over one fresh TCP connection (raw engine)."""

    def __init__(self, request: bytes, kind: str, probe: bool, done: asyncio.Future):
        self.request = request
        self.probe = probe  # hang up right after the first content delta
        self.done = done
        self.sse = SSE(kind)
        self.transport = None
        self.head = b""
        self.in_body = False
        self.chunked = False
        self.cbuf = b""
        self.clen: int | None = None
        self.status = 0
        self.t_sent = 0.0
        self.t_headers = None
        self.body_done = False
        self.stream_id: str | None = None  # x-stream-id (RESUMABLE_STREAMS): what a reader elsewhere resumes
        self.on_head = None  # called with the stream id once the head is in (the resume path's reader)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.t_sent = time.perf_counter()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        try:
            if not self.in_body:
                self.head += data
                i = self.head.find(b"\r\n\r\n")
                if i < 0:
                    return
                head, data = self.head[:i], self.head[i + 4 :]
                self.head = b""
                self.in_body = True
                self.t_headers = t
                lines = head.split(b"\r\n")
                self.status = int(lines[0].split(b" ", 2)[1])
                for line in lines[1:]:
                    k, _, v = line.partition(b":")
                    k = k.strip().lower()
                    if k == b"transfer-encoding" and b"chunked" in v.lower():
                        self.chunked = True
                    elif k == b"x-stream-id":
                        self.stream_id = v.strip().decode("latin-1")
                if self.on_head is not None and self.status == 200:
                    self.on_head(self.stream_id)
                if not data:
                    return
            if self.chunked:
                self._chunks(data, t)
            else:
                self.sse.feed(data, t)
        except Exception as exc:  # a malformed response counts as an error, never crashes the wave
            self.sse.error = f"parse: {exc!r}"[:200]
            self._finish()
            return
        if self.body_done or self.sse.end or self.sse.error or (self.probe and self.sse.times):
            self._finish()

    def _chunks(self, data: bytes, t: float) -> None:
        buf = self.cbuf + data if self.cbuf else data
        pos = 0
        while True:
            if self.clen is None:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                if size == 0:
                    self.body_done = True
                    break
                self.clen = size
            if len(buf) - pos < self.clen + 2:
                break
            self.sse.feed(buf[pos : pos + self.clen], t)
            pos += self.clen + 2
            self.clen = None
        self.cbuf = buf[pos:]

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _request(target: dict, marker: str) -> tuple[bytes, bytes]:
    """(path, body) of one request for ``target`` carrying ``marker`` in the user message."""
    if target["kind"] == APP:
        body = {"prompt": marker, **({"model": target["model"]} if target.get("model") else {})}
    else:
        body = {
            "model": target["model"],
            "messages": [{"role": "user", "content": marker}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return target["path"].encode(), json.dumps(body, separators=(",", ":")).encode()


def _record(
    i,
    marker,
    status,
    sse: SSE,
    t_sched,
    t_conn,
    t_open,
    t_sent,
    t_headers,
    t_close,
    err,
    anchor,
    expected: tuple[int, int | None],
    probe: bool,
) -> dict:
    """``expected``: (content deltas, characters of text or None)."""
    times = sse.times
    n_expected, chars_expected = expected
    ok = (
        err is None
        and status == 200
        and sse.error is None
        and (bool(times) if probe else (sse.end and len(times) == n_expected and chars_expected in (None, sse.chars)))
    )
    if ok or err is not None:
        error = err
    elif status != 200:
        error = f"http_{status}" if status else "no_response"
    elif sse.error:
        error = sse.error
    elif not times:
        error = "no_delta"
    elif not sse.end:
        error = "cut_off"
    elif len(times) != n_expected:
        error = f"deltas_{len(times)}"
    else:
        error = "wrong_text"
    return {
        "i": i,
        "marker": marker,
        "ok": ok,
        "error": error,
        "status": status,
        "late_ms": round((t_conn - t_sched) * 1000, 3),
        "connect_ms": round((t_open - t_conn) * 1000, 3) if t_open else None,
        "headers_ms": round((t_headers - t_sent) * 1000, 3) if t_headers and t_sent else None,
        "ttfd_ms": round((times[0] - t_sent) * 1000, 3) if times else None,
        "d": [round((t - t_sent) * 1000, 3) for t in times],
        "chars": sse.chars,
        "end": sse.end,
        "sent_wall": (t_sent + anchor) if t_sent else None,
        "open": t_open or t_conn,
        "close": t_close,
    }


def _head(method: bytes, path: bytes, target: dict, body: bytes) -> bytes:
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\nHost: "
        + target["hostport"].encode()
        + b"\r\n"
        + (b"Content-Type: application/json\r\n" if body else b"")
        + b"Accept: text/event-stream\r\n"
        + b"".join(k.encode() + b": " + v.encode() + b"\r\n" for k, v in target.get("headers", {}).items())
        + (b"Content-Length: " + str(len(body)).encode() + b"\r\n" if body else b"")
        + b"Connection: close\r\n\r\n"
    )


async def _follow(loop, target: dict, follow: dict, stream_id: str | None, timeout: float) -> dict:
    """A reader of a resumable stream on another instance: GET the resume route with the stream's id
    and read its events to the end; when each content delta was parsed (perf_counter)."""
    if not stream_id:
        return {"error": "no x-stream-id header", "times": [], "sent": None, "status": 0}
    path = follow["path"].replace("{id}", stream_id).encode()
    done = loop.create_future()
    proto = Stream(
        _head(b"GET", path, {**follow, "headers": target.get("headers", {})}, b""), target["kind"], False, done
    )
    transport = None
    err = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(lambda: proto, follow["host"], follow["port"])
            await done
    except TimeoutError:
        err = "timeout"
    except OSError as exc:
        err = f"connect: {exc.strerror or exc!r}"[:120]
    finally:
        if transport is not None:
            transport.close()
    if err is None and proto.status != 200:
        err = f"http_{proto.status}" if proto.status else "no_response"
    elif err is None and (proto.sse.error or not proto.sse.end):
        err = proto.sse.error or "cut_off"
    return {"error": err, "times": proto.sse.times, "sent": proto.t_sent or None, "status": proto.status}


async def _raw_one(loop, target, i, marker, at, expected, probe, timeout, anchor) -> dict:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    path, body = _request(target, marker)
    head = _head(b"POST", path, target, body)
    done = loop.create_future()
    proto = Stream(head + body, target["kind"], probe, done)
    follow = target.get("follow")
    reader: list[asyncio.Task] = []
    if follow and i % max(1, follow.get("every", 10)) == 0:
        proto.on_head = lambda sid: reader.append(loop.create_task(_follow(loop, target, follow, sid, timeout)))
    t_conn = time.perf_counter()
    t_open = None
    err = None
    transport = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(lambda: proto, target["host"], target["port"])
            t_open = time.perf_counter()
            await done
    except TimeoutError:
        err = "timeout"
    except OSError as exc:
        err = f"connect: {exc.strerror or exc!r}"[:120]
    finally:
        if transport is not None:
            transport.close()
    t_close = time.perf_counter()
    rec = _record(
        i,
        marker,
        proto.status,
        proto.sse,
        at,
        t_conn,
        t_open,
        proto.t_sent or None,
        proto.t_headers,
        t_close,
        err,
        anchor,
        expected,
        probe,
    )
    if proto.stream_id:
        rec["stream_id"] = proto.stream_id
    if reader:
        got = await reader[0]
        base = proto.t_sent
        rec["follower"] = {
            "error": got["error"],
            "status": got["status"],
            "sent_ms": round((got["sent"] - base) * 1000, 3) if got["sent"] and base else None,
            "d": [round((t - base) * 1000, 3) for t in got["times"]] if base else [],
        }
    return rec


async def _httpx_one(client, target, i, marker, at, expected, probe, timeout, anchor) -> dict:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    path, body = _request(target, marker)
    sse = SSE(target["kind"])
    status = 0
    err = None
    t_conn = time.perf_counter()
    t_sent = t_headers = None
    headers = {"content-type": "application/json", "accept": "text/event-stream", **target.get("headers", {})}
    try:
        async with asyncio.timeout(timeout):
            t_sent = time.perf_counter()  # httpx connects inside send(): connect time is included here
            async with client.stream("POST", target["url"], content=body, headers=headers) as resp:
                t_headers = time.perf_counter()
                status = resp.status_code
                async for chunk in resp.aiter_raw():
                    sse.feed(chunk, time.perf_counter())
                    if sse.end or sse.error or (probe and sse.times):
                        break
    except TimeoutError:
        err = "timeout"
    except Exception as exc:  # httpx errors: connection refused, reset, pool timeout...
        err = f"httpx: {type(exc).__name__}"
    t_close = time.perf_counter()
    return _record(i, marker, status, sse, at, t_conn, None, t_sent, t_headers, t_close, err, anchor, expected, probe)


async def run_wave(cmd: dict) -> dict:
    """Run the streams of one wave; ``cmd``: target, items [[index, marker, offset_s]], start_at
    (perf_counter clock), expected (content deltas), expected_chars, probe, timeout, engine."""
    loop = asyncio.get_running_loop()
    anchor = time.time() - time.perf_counter()
    target = cmd["target"]
    start_at = cmd.get("start_at") or time.perf_counter()
    expected = (cmd["expected"], cmd.get("expected_chars"))
    probe, timeout = cmd.get("probe", False), cmd.get("timeout", 60.0)
    cpu0 = time.process_time()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    items = cmd["items"]
    if cmd.get("engine", "raw") == "httpx":
        import httpx

        n = len(items)
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
            records = await asyncio.gather(
                *(
                    _httpx_one(client, target, i, marker, start_at + off, expected, probe, timeout, anchor)
                    for i, marker, off in items
                )
            )
    else:
        records = await asyncio.gather(
            *(
                _raw_one(loop, target, i, marker, start_at + off, expected, probe, timeout, anchor)
                for i, marker, off in items
            )
        )
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "records": records,
        "client_cpu_s": time.process_time() - cpu0,
        "client_maxrss_kb": ru1.ru_maxrss,
        "ctx_switches": (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw),
        "pid": os.getpid(),
    }


async def serve() -> None:
    """JSON commands on stdin, one per line; one JSON result per line on stdout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    with contextlib.suppress(ImportError):  # imported up front, so that the first httpx wave does not start late
        importlib.import_module("httpx")
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "loop": type(loop).__module__}) + "\n")
    out.flush()
    while True:
        line = await reader.readline()
        if not line:
            return
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        try:
            result = await run_wave(cmd)
        except Exception as exc:  # report, keep serving
            result = {"fatal": repr(exc)}
        out.write(json.dumps(result, separators=(",", ":")) + "\n")
        out.flush()


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _run(coro, use_uvloop: bool):
    if use_uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="read JSON commands from stdin (used by run.py)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--url", help="one-off: stream URL (e.g. http://127.0.0.1:PORT/api/chat)")
    p.add_argument("--kind", choices=(OPENAI, APP), default=APP)
    p.add_argument("--model", default="cadence")
    p.add_argument("-n", type=int, default=1)
    p.add_argument("--ramp", type=float, default=0.0, help="seconds over which the n streams start")
    p.add_argument("--expected", type=int, default=40)
    p.add_argument("--engine", choices=("raw", "httpx"), default="raw")
    args = p.parse_args(argv)
    _raise_nofile()
    if args.serve:
        _run(serve(), args.loop == "uvloop")
        return 0
    if not args.url:
        p.error("--url or --serve")
    from urllib.parse import urlsplit

    u = urlsplit(args.url)
    target = {
        "kind": args.kind,
        "host": u.hostname,
        "port": u.port,
        "hostport": u.netloc,
        "path": u.path,
        "url": args.url,
        "model": args.model,
    }
    items = [[i, f"loadgen {i}", args.ramp * i / max(1, args.n)] for i in range(args.n)]
    result = _run(
        run_wave({"target": target, "items": items, "expected": args.expected, "engine": args.engine}),
        args.loop == "uvloop",
    )
    recs = result["records"]
    ttfd = sorted(r["ttfd_ms"] for r in recs if r["ttfd_ms"] is not None)
    print(
        json.dumps(
            {
                "ok": sum(r["ok"] for r in recs),
                "n": len(recs),
                "errors": sorted({r["error"] for r in recs if r["error"]}),
                "ttfd_p50_ms": ttfd[len(ttfd) // 2] if ttfd else None,
                "client_cpu_s": round(result["client_cpu_s"], 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
