"""What is HTTP, the same for every API: reading a request body (the content type, the size limit,
strict JSON, a request model), compact JSON out (``dumps``), and the event-stream response that always
closes its events (the events themselves are framed by chatstream/sse.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from . import memory, sse
from .errors import ApiError, ClientGone, ErrorKind, invalid_request

log = logging.getLogger("chatstream")
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", bound=Response)

# --- reading a request ------------------------------------------------------------------------

# curl -d sends application/x-www-form-urlencoded unless told otherwise; a JSON body is never valid
# form data for these endpoints, so that type (and none at all) is read as JSON. Anything else is
# 415. (Cross-site form posts are refused by origin, before this: docs/deploy.md.)
_ACCEPTED_AS_JSON = {"", "application/json", "application/x-www-form-urlencoded"}
MAX_DEPTH = 128  # JSON nesting a request may have: far beyond any API's, and bounded for our recursion


async def read_json(request: Request, limit: int) -> object:
    """The request's body as strict JSON: 415 for another content type, 413 as soon as the body is
    known to exceed ``limit`` (the rest is not read), 400 for anything that is not strict JSON. A
    caller that hangs up while sending it raises ``ClientGone``."""
    require_json_content_type(request.headers.get("content-type"))
    return parse_json_body(await read_body(request, limit))


def require_json_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in _ACCEPTED_AS_JSON and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, ErrorKind.UNSUPPORTED_MEDIA_TYPE, "send the body as Content-Type: application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (the rest is not read)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, ErrorKind.REQUEST_TOO_LARGE, f"the body exceeds {limit} bytes")


def too_deep(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether parsed JSON nests deeper than ``limit`` (iterative: it must not recurse itself)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _has_lone_surrogate(value: object) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON syntax, but no JSON encoder can send it on
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


# json.loads with these options, built once: json.loads with any option builds a decoder per call.
_STRICT = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite).decode


def parse_json_body(raw: bytes) -> object:
    """Strict JSON: UTF-8 only, no NaN/Infinity (nor numbers that overflow to it), no lone
    surrogates, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request("the body is not valid UTF-8") from None
    try:
        if text.startswith("\ufeff"):  # as json.loads says it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        data = _STRICT(text)
    except RecursionError:
        raise invalid_request("the body is nested too deeply") from None
    except ValueError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    # Each walk only where the text allows what it looks for: no deeper nesting than the text has
    # brackets (strings' included), and no surrogate but from a \u escape (strict UTF-8 has none).
    # A request's messages are walked twice otherwise, before its upstream call is made.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and too_deep(data):
        raise invalid_request(f"the body is nested deeper than {MAX_DEPTH} levels")
    if b"\\u" in raw and _has_lone_surrogate(data):
        raise invalid_request("the body contains an unpaired UTF-16 surrogate escape")
    return data


def validate_object(model: type[M], data: object, describe: Callable[[dict], tuple[str, str | None]]) -> M:
    """``data`` as an API's request model, or a 400: ``describe`` turns pydantic's error into the
    API's (message, param). Of several errors, the first that is not a union branch's type mismatch
    is the one that says what is wrong (for ``stop: ["a", ""]``: the empty item, not "not a string")."""
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        telling = [e for e in errors if not e["type"].endswith("_type")] if len(errors) > 1 else []
        message, param = describe(dict((telling or errors)[0]))
        raise invalid_request(message, param) from None


def with_request_id(response: R) -> R:
    """Every answer carries ``x-request-id``: the one it has (the upstream's, or the request's own in
    its log line), else a new one, so that a caller's report can be matched with the app's logs."""
    if "x-request-id" not in response.headers:
        response.headers["x-request-id"] = uuid.uuid4().hex
    return response


# An answer no cache may keep (a stream, a state read, an admin answer, a page).
NO_STORE = {"Cache-Control": "no-store"}


def error_headers(error: ApiError) -> dict[str, str]:
    """The headers of every error status: the error's own (``Retry-After``), ``no-store``, and
    ``x-should-retry`` saying what the body's ``retryable`` says (the OpenAI SDKs retry on it)."""
    return {**error.headers, **NO_STORE, "x-should-retry": "true" if error.retryable else "false"}


# After the total limit, how long a response blocked by a caller who stopped reading may still try
# to write its final event before the connection is dropped.
WRITE_GRACE_SECONDS = 2.0
# A big JSON answer is written in pieces of about this size; a longer string is escaped a slice of
# this many characters at a time.
SLICE_BYTES = 64 * 1024

_NO_NAN = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def _skeleton(value: Any, long: list[str], mark: str) -> Any:
    """``value`` with each string longer than SLICE_BYTES replaced by ``mark`` + its index in
    ``long`` + ``mark`` (containers copied only on the way to one)."""
    if type(value) is str:
        if len(value) <= SLICE_BYTES:
            return value
        long.append(value)
        return f"{mark}{len(long) - 1}{mark}"
    if type(value) is dict:
        copied = None
        for key, item in value.items():
            new = _skeleton(item, long, mark)
            if new is not item:
                copied = copied if copied is not None else dict(value)
                copied[key] = new
        return value if copied is None else copied
    if type(value) is list:
        items = [_skeleton(item, long, mark) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def _escaped(text: str) -> Iterator[bytes]:
    """A string's JSON text without its quotes, a slice at a time (escaping is per character)."""
    for start in range(0, len(text), SLICE_BYTES):
        yield dumps(text[start : start + SLICE_BYTES])[1:-1]


class JsonAnswer(Response):
    """A JSON answer that may be big (a non-streamed completion), as JSONResponse writes it but
    without ever making its whole text: the object with its long strings replaced by markers is
    encoded (small), and the long strings are escaped a slice at a time as they are written, so the
    answer costs its object and little more, however long its text. Its length is known before (the
    ``content-length`` header, as JSONResponse sends it).

    Each piece is written once the server has taken the one before (an ASGI server waits before a
    write while its buffer is full; one big write would be buffered whole, after the app is done
    with it), so that the answer is over only when its caller has it, has hung up, or
    ``WRITE_GRACE_SECONDS`` past ``give_up_at`` (a caller who stops reading holds it no longer than
    a stream). Then the memory it took goes back to the operating system (memory.py)."""

    media_type = "application/json"

    def __init__(self, content: Any, give_up_at: float, headers: dict[str, str] | None = None):
        self.give_up_at = give_up_at
        long: list[str] = []
        mark = "\x00" + uuid.uuid4().hex  # written \u0000 + 32 random hex digits: no text can hold it by chance
        shape = _skeleton(content, long, mark)
        try:
            encoded = _NO_NAN(shape).encode("utf-8")  # NaN: a ValueError, as JSONResponse raises
        except UnicodeEncodeError:  # a lone surrogate from upstream: escape it rather than fail
            encoded = _ESCAPED(shape).encode("ascii")
        escaped_mark = re.escape(dumps(mark)[1:-1])
        parts = re.split(b'"' + escaped_mark + rb"(\d+)" + escaped_mark + b'"', encoded)
        # parts: text, index, text, index, ..., text
        self._parts: list[bytes | str] = [part if i % 2 == 0 else long[int(part)] for i, part in enumerate(parts)]
        self.length = sum(
            len(part) if isinstance(part, bytes) else 2 + sum(len(piece) for piece in _escaped(part))
            for part in self._parts
        )
        super().__init__(None, 200, {**(headers or {}), "content-length": str(self.length)})

    def pieces(self) -> Iterator[bytes]:
        """The answer's bytes in pieces of about SLICE_BYTES."""
        pending = bytearray()
        for part in self._parts:
            for piece in (part,) if isinstance(part, bytes) else itertools.chain((b'"',), _escaped(part), (b'"',)):
                pending += piece
                while len(pending) >= SLICE_BYTES:
                    yield bytes(pending[:SLICE_BYTES])
                    del pending[:SLICE_BYTES]
        if pending:
            yield bytes(pending)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout_at(self.give_up_at + WRITE_GRACE_SECONDS):
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                more = self.pieces()
                piece = next(more, b"")
                for following in more:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    piece = following
                await send({"type": "http.response.body", "body": piece, "more_body": False})
        except TimeoutError:
            log.warning("a caller stopped reading its answer past the total time limit; dropping its connection")
        finally:
            memory.released(self.length)


# --- JSON out, the event-stream response ------------------------------------------------------

# Built once: json.dumps with any option builds a new encoder per call.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_ESCAPED = json.JSONEncoder(separators=(",", ":")).encode


def dumps(payload: Any) -> bytes:
    """Compact JSON in UTF-8 (raw, not \\u-escaped: smaller, and what OpenAI sends)."""
    try:
        return _COMPACT(payload).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from upstream: escape it rather than fail
        return _ESCAPED(payload).encode("ascii")


def stored_objects(events: bytes) -> list[dict]:
    """The JSON objects of events as we wrote them (a resumable stream's stored ones); a payload
    that is no JSON object is skipped."""
    objects = []
    for payload in sse.Parser().feed(events):
        try:
            value = json.loads(payload)
        except ValueError:
            continue
        if isinstance(value, dict):
            objects.append(value)
    return objects


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator, even when the caller hung up
    while the generator was parked at ``yield`` (Starlette then only cancels the sending task), and
    that gives up writing shortly after the stream's total limit, however slowly the caller reads.
    ``on_close`` runs last in every case, also when Starlette never started the body (a caller gone
    before the first write): a generator that never ran has no ``finally`` of its own to run.
    ``listener``: a task already listening for the caller's disconnect on the same ``receive``
    (the endpoint's, while it waited for the first event), which the response listens with instead
    of starting its own: a task, a receive and a cancel fewer per stream, before its first event
    goes out (~2.5% of the CPU a request takes until then). ``closed_by_body``: what ``on_close``
    closes, the body closes itself when it runs to its end (the endpoint's: its events end with it);
    once the body was written whole, the close has nothing to do then, and takes no shield (~1% of
    a short stream's CPU)."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(
        self,
        content: AsyncIterable[bytes],
        give_up_at: float,
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
        listener: asyncio.Future | None = None,
        closed_by_body: bool = False,
    ):
        super().__init__(content, headers={**NO_STORE, "X-Accel-Buffering": "no", **(headers or {})})
        self.give_up_at = give_up_at
        self.on_close = on_close
        self.listener = listener
        self.closed_by_body = closed_by_body
        self.written = False  # the body was written whole (it ran to its end)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout_at(self.give_up_at + WRITE_GRACE_SECONDS):
                await self._serve(scope, receive, send)
        except TimeoutError:
            log.warning("a caller stopped reading past the total time limit; dropping its connection")
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the event generator, then ``on_close``: once served, or instead of being served.
        Shielded: it runs on the way out of a cancelled task."""
        if self.listener is not None:
            self.listener.cancel()  # a response never served has it still listening
        if self.written and self.closed_by_body:
            return
        with anyio.CancelScope(shield=True):
            close = getattr(self.body_iterator, "aclose", None)  # the events as given
            if close is not None:
                await close()
            if self.on_close is not None:
                await self.on_close()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's StreamingResponse with the roles of its two tasks swapped: the body is written
        by the task that has the response (its head and first event go out at once, not one turn of
        the event loop later in a task of their own, which under load waits behind every other ready
        task), and the disconnect is listened for in a task of its own. Either ending stops the
        other, as in Starlette: a disconnect cancels the writing (that cancel alone is taken back,
        as ``asyncio.timeout`` does), the end of the body cancels the listener. Plain asyncio, not
        an anyio task group: that cost about a tenth of the app's CPU per stream (make bench-quick).
        ASGI 2.4 servers report a disconnect as a failed write: Starlette's own path."""
        spec_version = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
        if scope["type"] != "http" or spec_version >= (2, 4):
            if self.listener is not None:
                self.listener.cancel()  # Starlette listens its own way
            await super().__call__(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None, "a response is written by a task"
        cancelling = task.cancelling()
        writing, gone = True, False

        def hung_up(listener: asyncio.Future) -> None:
            nonlocal gone
            if writing and not listener.cancelled():  # a disconnect (or a failure to receive)
                gone = True
                task.cancel()

        listener = self.listener or asyncio.ensure_future(self.listen_for_disconnect(receive))
        listener.add_done_callback(hung_up)
        try:
            await self.stream_response(send)
            self.written = True
        except asyncio.CancelledError:
            if not gone:
                raise
            gone = False
            if task.uncancel() > cancelling:  # cancelled from outside as well
                raise
        finally:
            writing = False
            if gone:  # the disconnect's cancel came, but something below took it: take it back
                task.uncancel()
            listener.cancel()
        if listener.done() and not listener.cancelled() and (failure := listener.exception()) is not None:
            raise failure
        if self.background is not None:
            await self.background()
