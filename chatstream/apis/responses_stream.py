"""The Responses API's stream as the upstream sends it (the counterpart of completions.py):
``ResponseStream`` feeds each upstream event through the pipeline's text steps, ``ResponseEncoder``
writes our events as named SSE events, and ``filter_response`` filters a whole response object.

Events are forwarded as named events (``event: <type>``), with their ``sequence_number`` and order
unchanged. ``response.created`` / ``response.in_progress`` (and a background response's
``response.queued``) are held until the first event that is real output, so the status rule can
still answer an early failure with an HTTP status. The stream is done at ``response.completed``,
``response.incomplete`` or ``response.failed``; the usage comes from the terminal event's
``response.usage``. A failure after output ends the stream with an ``error`` event
(``{"type": "error", "sequence_number": next, "code", "message", "param"}``, the documented shape).

Text steps (``BLOCKED_TERMS`` and your own) see every text the model streams: each content part's
text or refusal (per ``output_index``/``content_index``), each function call's arguments, each
reasoning summary part and reasoning text, and a spoken answer's transcript
(``response.audio.transcript.delta``; its ``.done`` event carries no text, the held tail goes out in
the last delta). The repeated full texts (``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, the terminal ``response``, the
non-streamed response) are replaced by what was released for that part, so a reader of the deltas and
a reader of the final object see the same text. To give a filter's held-back tail a place in the
deltas without inventing events (which would shift every later ``sequence_number``), each delta event
is sent when the next upstream event arrives while text steps are on: the part's last delta then
carries the tail. Without text steps every event is forwarded unchanged as it arrives."""

from __future__ import annotations

import re
from collections.abc import Callable

from .. import sse
from ..errors import ApiError, ProviderError, UpstreamMalformed, UpstreamReported, provider_error
from ..http import dumps
from ..pipeline import Pipeline, TextFilter
from ..record import StreamRecord
from ..stream import NOTHING, Chunk, Done, Event

# Events held until the first real output (the status rule waits for output).
OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Delta events carrying text, and the text channel each one belongs to.
TEXT_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_summary_text.delta",
        "response.audio.transcript.delta",
    }
)
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def _delta_key(data: dict) -> tuple | None:
    """The text channel of a delta or done event: ``("c", output, content)`` for a content part's text
    or refusal, ``("a", output)`` for function-call arguments, ``("s", output, summary)`` for a
    reasoning summary part."""
    kind = data.get("type", "")
    if kind.startswith("response.audio.transcript."):  # one spoken answer per response: no index
        return ("t",)
    if kind.startswith("response.function_call_arguments."):
        return ("a", _index(data, "output_index"))
    if kind.startswith(("response.reasoning_summary_text.", "response.reasoning_summary_part.")):
        return ("s", _index(data, "output_index"), _index(data, "summary_index"))
    if kind.startswith(
        ("response.output_text.", "response.refusal.", "response.reasoning_text.", "response.content_part.")
    ):
        return ("c", _index(data, "output_index"), _index(data, "content_index"))
    return None


def _index(data: dict, name: str) -> int:
    value = data.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UpstreamMalformed(f"the model server sent an event whose {name} is not a number")
    return value


def _text_field(part: dict) -> str | None:
    """The field holding a content part's text: ``text`` (output_text, reasoning_text) or ``refusal``."""
    if isinstance(part.get("text"), str):
        return "text"
    if isinstance(part.get("refusal"), str):
        return "refusal"
    return None


class ResponseStream:
    """One streamed response: ``feed`` each upstream event, forward what it returns. ``keep``: keep
    the released output text (for the after-steps) and the generated text (for what a partial stream
    is charged)."""

    def __init__(self, pipeline: Pipeline | None, resumed: bool = False, keep: bool = False):
        self._make_filter = pipeline.text_filter if pipeline is not None and pipeline.filters_text else None
        self.feed_waits = pipeline is not None and pipeline.moderates
        self.plain: Callable[[dict], Chunk | None] | None = None  # every event is read by ``feed``
        self.usage: dict | None = None
        self.released: dict[int, list[str]] | None = {} if keep else None
        self.generated: dict[int, list[str]] | None = {0: []} if keep else None
        # A re-stream after ``starting_after``: its deltas are only the end of each text, so the full
        # texts are the upstream's, through the text steps whole (as GET /responses/{id} gives them).
        self._resumed = resumed
        self._filters: dict[tuple, TextFilter] = {}
        self._released: dict[tuple, str] = {}  # what the filters released, per channel
        self._texts: dict[tuple, str] = {}  # each channel's full text, once done
        self._flushed: set[tuple] = set()
        self._pending: tuple[tuple, dict] | None = None  # a delta event waiting for the next event
        self._last_delta: dict[tuple, dict] = {}
        self._extra: list[dict] = []  # tails whose last delta was already sent
        self.status: str | None = None
        self.model = self.id = self.created = None

    # -- the core's protocol
    def probe(self) -> ResponseStream:
        return ResponseStream(None, resumed=self._resumed)

    @property
    def done(self) -> bool:
        return self.status is not None

    @property
    def finished(self) -> bool:
        # A re-stream after ``starting_after`` may hold no terminal event (it came before N): a clean
        # end is its end.
        return self.done or self._resumed

    def note(self, data: dict) -> None:
        response = data.get("response")
        if isinstance(response, dict):
            self.model = response.get("model") or self.model
            self.id = response.get("id") or self.id
            self.created = response.get("created_at") or self.created
            if isinstance(response.get("usage"), dict):
                self.usage = response["usage"]

    async def feed(self, data: dict) -> Chunk:
        kind = data.get("type")
        if not isinstance(kind, str) or not _EVENT_TYPE.fullmatch(kind):
            raise UpstreamMalformed("the model server sent an event without a valid type")
        if kind == "error":
            raise _error_event(data)
        if kind in TEXT_DELTAS and not isinstance(data.get("delta"), str):
            raise UpstreamMalformed(f"the model server sent a {kind} event without a text delta")
        self.note(data)
        output = kind not in OPENING
        delta = kind in TEXT_DELTAS
        if self.generated is not None and kind in TEXT_DELTAS:
            self.generated[0].append(data["delta"])
        if kind in TERMINAL:
            status = (data.get("response") or {}).get("status") if isinstance(data.get("response"), dict) else None
            self.status = status if isinstance(status, str) else kind.removeprefix("response.")
        if self._make_filter is None:
            if kind == "response.output_text.delta":
                self._keep(data.get("delta"))
            return Chunk(data, output=output, delta=delta)
        events = await self._filtered(kind, data)
        if not events:
            return NOTHING
        return Chunk(events[0], output=output, delta=delta, batch=tuple(events[1:]))

    def summary(self) -> Done:
        return Done(self.status, {}, self.usage, self.model, self.id, self.created)

    # -- text steps
    def _keep(self, text) -> None:
        if self.released is not None and isinstance(text, str) and text:
            self.released.setdefault(0, []).append(text)

    async def _filtered(self, kind: str, data: dict) -> list[dict]:
        events = []
        key = _delta_key(data)
        if kind in TEXT_DELTAS and key is not None:
            if key in self._flushed:  # a delta after its part was done: nothing more may go out
                return [*self._release(), {**data, "delta": ""}]
            if key not in self._filters:
                self._filters[key] = self._new_filter()
            text = await self._filters[key].feed(data["delta"])
            self._released[key] = self._released.get(key, "") + text
            new = {**data, "delta": text}
            events = self._release()
            self._pending = (key, new)
            self._last_delta[key] = new
            if kind == "response.output_text.delta":
                self._keep(text)
            return events
        self._extra = []
        rewritten = await self._rewrite(kind, data)
        events = self._release() + self._extra + [rewritten]
        self._extra = []
        return events

    def _release(self) -> list[dict]:
        if self._pending is None:
            return []
        _, event = self._pending
        self._pending = None
        return [event]

    def _new_filter(self) -> TextFilter:
        assert self._make_filter is not None, "a text filter is made only when the pipeline filters text"
        return self._make_filter()

    async def _full(self, key: tuple, text: str) -> str:
        """The text of a whole part: what was released for it (its held tail flushed into its last
        delta first), or, for a part that came without deltas (or a resumed stream), the upstream's
        text through filters of its own."""
        if key not in self._texts:
            if key in self._filters and key not in self._flushed:
                tail = await self._filters[key].flush()
                if tail:
                    self._released[key] += tail
                    self._carry(key, tail)
                    if key[0] == "c" and self._last_delta[key].get("type") == "response.output_text.delta":
                        self._keep(tail)
            self._flushed.add(key)
            if key in self._filters and not self._resumed:
                self._texts[key] = self._released[key]
            else:
                text_filter = self._new_filter()
                self._texts[key] = await text_filter.feed(text) + await text_filter.flush()
        return self._texts[key]

    def _carry(self, key: tuple, tail: str) -> None:
        """Put a flushed tail into the channel's last delta: the one still pending, normally (its part
        is done right after it). If another event came in between, that delta has been sent, and a copy
        of it carries the tail (same ``sequence_number``: nothing later is renumbered)."""
        if self._pending is not None and self._pending[0] == key:
            self._pending = (key, {**self._pending[1], "delta": self._pending[1]["delta"] + tail})
        else:
            self._extra.append({**self._last_delta[key], "delta": tail})

    async def _rewrite(self, kind: str, data: dict) -> dict:
        """A new event whose full texts are the released ones (the upstream's dict is not changed)."""
        key = _delta_key(data)
        new = data
        if key is not None:
            if kind == "response.audio.transcript.done":  # no text of its own: the held tail goes out now
                await self._full(key, "")
            elif kind in (
                "response.output_text.done",
                "response.reasoning_text.done",
                "response.reasoning_summary_text.done",
            ) and isinstance(data.get("text"), str):
                new = {**data, "text": await self._full(key, data["text"])}
            elif kind == "response.refusal.done" and isinstance(data.get("refusal"), str):
                new = {**data, "refusal": await self._full(key, data["refusal"])}
            elif kind == "response.function_call_arguments.done" and isinstance(data.get("arguments"), str):
                new = {**data, "arguments": await self._full(key, data["arguments"])}
            elif kind in ("response.content_part.done", "response.reasoning_summary_part.done") and isinstance(
                data.get("part"), dict
            ):
                field = _text_field(data["part"])
                if field:
                    new = {**data, "part": {**data["part"], field: await self._full(key, data["part"][field])}}
        elif kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            new = {**data, "item": await self._item(_index(data, "output_index"), data["item"])}
        elif kind in TERMINAL and isinstance(data.get("response"), dict):
            if ("t",) in self._filters:  # a transcript that never got its done event
                await self._full(("t",), "")
            new = {**data, "response": await self._response(data["response"])}
        return new

    async def _item(self, index: int, item: dict) -> dict:
        new = dict(item)
        if isinstance(item.get("arguments"), str) and item.get("type") == "function_call":
            new["arguments"] = await self._full(("a", index), item["arguments"])
        for name, letter in (("content", "c"), ("summary", "s")):
            parts = item.get(name)
            if not isinstance(parts, list):
                continue
            new_parts = []
            for i, part in enumerate(parts):
                field = _text_field(part) if isinstance(part, dict) else None
                if field:
                    part = {**part, field: await self._full((letter, index, i), part[field])}
                new_parts.append(part)
            new[name] = new_parts
        return new

    async def _response(self, response: dict) -> dict:
        output = response.get("output")
        if not isinstance(output, list):
            return response
        items = [await self._item(i, item) if isinstance(item, dict) else item for i, item in enumerate(output)]
        return {**response, "output": items}


def _error_event(data: dict) -> ApiError:
    """The upstream's ``error`` event (documented flat shape, or nested under ``error``)."""
    nested = isinstance(data.get("error"), dict)
    inner = data["error"] if nested else data
    message = inner.get("message")
    provider = provider_error(inner)
    if provider is not None and not nested:  # the flat shape's ``type`` is the event's own ("error")
        provider = ProviderError(provider.code, None, provider.param)
    return UpstreamReported(message if isinstance(message, str) else "an error occurred during streaming", provider)


class ResponseEncoder:
    """Our events as the Responses API writes them: ``event: <type>\\ndata: <json>\\n\\n``."""

    def __init__(self) -> None:
        self.last_sequence = -1

    def __call__(self, item: Event) -> bytes | None:
        if isinstance(item, Chunk):
            out = []
            for data in (item.data, *item.batch):
                number = data.get("sequence_number")
                if isinstance(number, int) and not isinstance(number, bool):
                    self.last_sequence = max(self.last_sequence, number)
                out.append(sse.event(dumps(data), data["type"].encode()))
            return b"".join(out)
        if isinstance(item, Done):
            return None  # the terminal event was forwarded: nothing more to say
        error = item.error
        self.last_sequence += 1
        body = {
            "type": "error",
            "sequence_number": self.last_sequence,
            "code": error.provider.code if error.provider is not None else error.type,
            "message": error.message,
            "param": error.param,
            "chatstream_kind": error.type,
        }
        return sse.event(dumps(body), b"error")


async def filter_response(body: dict, pipeline: Pipeline, record: StreamRecord) -> dict:
    """A whole ``response`` object with its output texts through the text steps (a new dict)."""
    if not isinstance(body.get("output", []), list):
        raise UpstreamMalformed("the response is not an object with an output list")
    usage, status = body.get("usage"), body.get("status")
    record.ended(status if isinstance(status, str) else None, usage if isinstance(usage, dict) else None)
    if pipeline.filters_text:
        body = await ResponseStream(pipeline)._response(body)
    for item in body.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    record.keep_text(0, part["text"])
    return body
