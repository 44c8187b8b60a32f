"""One resumable answer being read: where it resumes, with which headers, how often and how long it
tries, and what ends it. Shared by the sync and the async transport (transport.py), which do the I/O.

The rules (docs/resumable.md, "SDKs that reconnect by themselves"):

- **Where**: the request's URL with its route (``/v1/chat/completions``, ``/chat/completions`` or
  ``/chat``) at the end of its path replaced by ``/streams/{id}``; a path ending otherwise has its last
  segment replaced. Same scheme, host and port. ``streams_url`` overrides it (a template with ``{id}``,
  or a function of the request URL and the id).
- **With**: ``Last-Event-ID`` = the id of the last whole event passed on; the request's
  ``Authorization``, ``api-key``, ``x-functions-key`` (and ``Ocp-Apim-Subscription-Key``) headers and
  its ``code`` query parameter; its timeouts.
- **How often**: a cut is retried after 0.25 s, then 0.5, 1, 2, 4, 4… s; at most ``max_attempts`` (8)
  reconnects and ``max_seconds`` (30) from the cut. A resume that passes a new event on starts a new
  count for the next cut.
- **What is retried**: a connection error or a body that ends before the final event; ``429`` and
  ``503`` (after ``Retry-After`` when it says longer than the backoff; giving up at once when it points
  past the time bound); ``408``, ``500``, ``502``, ``504``. Any other status (``404``: the stream is
  unknown or expired; ``400``: Last-Event-ID refused; ``401``/``403``) ends it.
- **Giving up**: the error of the cut is raised (``httpx.ReadError``, ``httpx.RemoteProtocolError``,
  a timeout: what the SDK maps to its connection error), with a note saying why; or, when the last
  body ended with the app's own error event (``stream_store_unavailable``, ``stream_moved``), that
  event is passed on."""

from __future__ import annotations

import email.utils
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from .splice import Splice

log = logging.getLogger("chatstream_client")

StreamsUrl = str | Callable[[httpx.URL, str], "str | httpx.URL"]

STREAM_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
ROUTES = ("/v1/chat/completions", "/chat/completions", "/chat")
FORWARDED = ("authorization", "api-key", "x-functions-key", "ocp-apim-subscription-key", "user-agent")
RETRIED = frozenset({408, 429, 500, 502, 503, 504})
CUT = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


@dataclass(frozen=True)
class Backoff:
    """How a cut is retried: waits of ``first_delay`` doubling to ``max_delay``; at most
    ``max_attempts`` reconnects within ``max_seconds`` of the cut."""

    max_attempts: int = 8
    max_seconds: float = 30.0
    first_delay: float = 0.25
    max_delay: float = 4.0

    def __post_init__(self) -> None:
        if self.max_attempts < 0 or self.max_seconds < 0 or self.first_delay < 0 or self.max_delay < self.first_delay:
            raise ValueError("Backoff: attempts and times must be >= 0, and max_delay >= first_delay")

    def delay(self, attempt: int) -> float:
        """The wait before reconnect number ``attempt`` (1, 2, …)."""
        return min(self.first_delay * 2 ** (attempt - 1), self.max_delay)


def streams_url_for(url: httpx.URL, stream_id: str, override: StreamsUrl | None = None) -> httpx.URL:
    """Where the stream ``stream_id``, answered to a request to ``url``, resumes (module docstring)."""
    if callable(override):
        target = httpx.URL(str(override(url, stream_id)))
    elif override is not None:
        target = httpx.URL(override.replace("{id}", stream_id))
    else:
        path = url.path
        route = next((r for r in ROUTES if path.endswith(r)), None)
        prefix = path[: -len(route)] if route else path.rsplit("/", 1)[0]
        target = url.copy_with(path=f"{prefix}/streams/{stream_id}", query=None)
    code = url.params.get("code")
    if code is not None and "code" not in target.params:
        target = target.copy_merge_params({"code": code})
    return target


def resumable_stream_id(response: httpx.Response) -> str | None:
    """The stream id of an answer this package can splice, or None (then it passes untouched)."""
    stream_id = response.headers.get("x-stream-id")
    if response.status_code != 200 or not stream_id or not STREAM_ID.fullmatch(stream_id):
        return None
    if response.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return None  # the transport sees the body before it is decoded: it cannot read its events
    if not response.headers.get("content-type", "").lower().startswith("text/event-stream"):
        return None
    return stream_id


def retry_after(response: httpx.Response) -> float | None:
    """``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date), in seconds."""
    try:
        return max(0.0, float(response.headers["retry-after-ms"]) / 1000)
    except (KeyError, ValueError):
        pass
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


class GiveUp(Exception):
    """Internal: the bound ran out or the app said no; ``Resumption.failure`` is what to raise."""


class Resumption:
    """The state of one spliced answer between its bodies."""

    def __init__(
        self,
        request: httpx.Request,
        stream_id: str,
        backoff: Backoff,
        streams_url: StreamsUrl | None,
        forwarded: tuple[str, ...] = FORWARDED,
    ):
        self.stream_id = stream_id
        self.splice = Splice()
        self.backoff = backoff
        self.url = streams_url_for(request.url, stream_id, streams_url)
        self._headers = {name: request.headers[name] for name in forwarded if name in request.headers}
        self._extensions = {k: v for k, v in request.extensions.items() if k == "timeout"}
        self._error: Exception | None = None  # the cut being repaired (raised when giving up)
        self._attempt = 0
        self._deadline = 0.0
        self._mark = -1  # splice.passed_events at the start of the current cut

    def cut(self, error: Exception | None) -> None:
        """The current body ended before the final event (``error``: how; None: it just ended)."""
        self.splice.body_ended()
        if self.splice.passed_events != self._mark:  # progress since the last cut: a new one
            self._mark = self.splice.passed_events
            self._attempt = 0
            self._deadline = time.monotonic() + self.backoff.max_seconds
            if error is None and self.splice.held is None:
                error = httpx.RemoteProtocolError(f"stream {self.stream_id} ended before its final event")
            self._error = error
            log.info("chatstream_client: stream %s cut after id %s (%r)", self.stream_id, self.splice.last_id, error)

    def next_delay(self, hint: float | None = None) -> float:
        """The wait before the next reconnect (``hint``: the last answer's Retry-After); raises GiveUp."""
        self._attempt += 1
        if self._attempt > self.backoff.max_attempts:
            raise GiveUp(f"{self.backoff.max_attempts} reconnects failed")
        delay = max(self.backoff.delay(self._attempt), hint or 0.0)
        if time.monotonic() + delay > self._deadline:
            raise GiveUp(f"no reconnect left within {self.backoff.max_seconds:g} s of the cut")
        log.info(
            "chatstream_client: stream %s: reconnect %d/%d in %.2f s",
            self.stream_id,
            self._attempt,
            self.backoff.max_attempts,
            delay,
        )
        return delay

    def request(self) -> httpx.Request:
        headers = {
            **self._headers,
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            "cache-control": "no-cache",
        }
        if self.splice.last_id is not None:
            headers["last-event-id"] = self.splice.last_id
        return httpx.Request("GET", self.url, headers=headers, extensions=dict(self._extensions))

    def note(self, error: Exception) -> None:
        """A reconnect failed before any answer (refused, reset, timed out)."""
        log.info("chatstream_client: stream %s: reconnect failed: %r", self.stream_id, error)

    def judge(self, response: httpx.Response) -> float | None:
        """A resume's answer: None to read its body; otherwise the Retry-After hint for the next
        attempt (the caller closes the answer). Raises GiveUp when the answer ends it."""
        if response.status_code == 200:
            self.splice.resume()
            return None
        log.info("chatstream_client: stream %s: resume answered %d", self.stream_id, response.status_code)
        if response.status_code in RETRIED:
            return retry_after(response) or 0.0
        raise GiveUp(f"the resume answered {response.status_code}")

    def failure(self, reason: GiveUp | Exception) -> Exception | None:
        """What giving up raises (None: the held event is passed on instead, and the stream ends)."""
        log.warning("chatstream_client: stream %s: giving up: %s", self.stream_id, reason)
        if self.splice.held is not None:
            return None
        error = self._error or httpx.RemoteProtocolError(f"stream {self.stream_id} was cut")
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(f"chatstream_client: stream {self.stream_id} not resumed after id {self.splice.last_id}: {reason}")
        return error
