"""Chat completions as the upstream sends them, through the pipeline's text steps: each streamed
chunk (``CompletionStream.feed``) and a whole non-streamed completion (``filter_completion``).

Every text the model returns goes through the text steps (``BLOCKED_TERMS`` and your own): the
content, the refusal, and each tool call's arguments, each with a filter of its own per choice, so
the guard is right however the upstream splits any of them. Filtering never changes the upstream's
dicts: it returns new ones.

Stream rules: chunks with empty ``choices`` (Azure's filter frames, the usage chunk) are not
forwarded; nothing a choice sends after its ``finish_reason`` is forwarded; a chunk is *output*
(what the status rule and the delta count wait for) when it carries text, a refusal or a tool call,
or finishes a choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..continuation import TEXT_DELTA, ChatContinuation, Known
from ..errors import UpstreamMalformed
from ..pipeline import CallRequest, Pipeline, TextFilter
from ..record import StreamRecord, TextParts
from ..stream import NOTHING, Chunk, Done, StreamProtocol

if TYPE_CHECKING:
    from ..upstreams.failover import Upstreams

TEXT_FIELDS = ("content", "refusal")
_ROLE_DELTA = TEXT_DELTA | {"refusal"}  # OpenAI's role chunk's delta (its refusal null)


def _index_ok(item: dict) -> bool:
    index = item.get("index", 0)
    return isinstance(index, int) and not isinstance(index, bool)


def _call_ok(call) -> bool:
    return isinstance(call, dict) and _index_ok(call) and isinstance(call.get("function") or {}, dict)


def _well_formed(choice) -> bool:
    """The shape this module relies on; anything else is the upstream's malformed data."""
    if not isinstance(choice, dict) or not _index_ok(choice):
        return False
    delta = choice.get("delta") or {}
    return (
        isinstance(delta, dict)
        and all(isinstance(delta.get(f) or "", str) for f in TEXT_FIELDS)
        and isinstance(delta.get("tool_calls") or [], list)
        and all(map(_call_ok, delta.get("tool_calls") or []))
        and isinstance(delta.get("function_call") or {}, dict)
        and isinstance(choice.get("finish_reason") or "", str)
    )


def _has_substance(delta: dict) -> bool:
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("refusal") or delta.get("function_call"))


def _empty_call(call) -> bool:
    """A tool-call fragment left with nothing to say once its arguments were held back."""
    return (
        isinstance(call, dict)
        and set(call) <= {"index", "function"}
        and not (call.get("function") or {}).get("arguments")
        and set(call.get("function") or {}) <= {"arguments"}
    )


class ChoiceFilters:
    """The text filters of one choice, one per text channel: ``content``, ``refusal`` and
    ``("tool", i)`` for the arguments of tool call ``i``."""

    def __init__(self, make: Callable[[], TextFilter]):
        self._make = make
        self._filters: dict[object, TextFilter] = {}

    async def feed(self, channel, text: str) -> str:
        if channel not in self._filters:
            self._filters[channel] = self._make()
        return await self._filters[channel].feed(text)

    async def flush_into(self, delta: dict) -> None:
        """The choice finished: what each filter held goes into ``delta`` (a new dict of ours)."""
        for channel, text_filter in self._filters.items():
            tail = await text_filter.flush()
            if not tail:
                continue
            if isinstance(channel, tuple):
                delta["tool_calls"] = [
                    *(delta.get("tool_calls") or []),
                    {"index": channel[1], "function": {"arguments": tail}},
                ]
            elif channel == "function_call":
                call = delta.get("function_call") or {}
                delta["function_call"] = {**call, "arguments": (call.get("arguments") or "") + tail}
            else:
                delta[channel] = (delta.get(channel) or "") + tail

    async def _arguments(self, channel, call: dict) -> dict:
        """``call`` (a tool call's ``function``, or a legacy ``function_call``) with its arguments,
        model output too, through ``channel``'s filter."""
        if not isinstance(call.get("arguments"), str) or not call["arguments"]:
            return call
        return {**call, "arguments": await self.feed(channel, call["arguments"])}

    async def filter_call(self, call):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return call
        return {**call, "function": await self._arguments(("tool", call.get("index", 0)), function)}

    async def filter_delta(self, delta: dict, final: bool) -> dict:
        """A new delta with every text through the filters (and, when ``final``, what they held)."""
        new = dict(delta)
        for field in TEXT_FIELDS:
            if delta.get(field):
                new[field] = await self.feed(field, delta[field])
        if delta.get("function_call"):
            new["function_call"] = await self._arguments("function_call", delta["function_call"])
        if delta.get("tool_calls"):
            calls = [await self.filter_call(c) for c in delta["tool_calls"]]
            new["tool_calls"] = [c for c in calls if not _empty_call(c)]
            if not new["tool_calls"]:
                del new["tool_calls"]
        if final:
            await self.flush_into(new)
        return new


class CompletionStream:
    """One streamed chat completion: ``feed`` each upstream chunk, forward what it returns.
    ``keep``: keep what the text steps released per choice (for the after-steps), and what the model
    generated (each choice's text, before the text steps: what a partial stream is charged for)."""

    def __init__(self, pipeline: Pipeline | None, choices: int = 1, keep: bool = False):
        self._make_filter = pipeline.text_filter if pipeline is not None and pipeline.filters_text else None
        self.feed_waits = pipeline is not None and pipeline.moderates
        self._filters: dict[int, ChoiceFilters] = {}
        self._wanted = choices
        self.finished: dict[int, str] = {}
        self.done = False  # the answer is complete: every wanted choice finished (kept up by _finish)
        # Without text steps a chunk is read without awaiting anything (StreamProtocol.plain); a
        # subclass with a feed of its own is read by it.
        plain = self._make_filter is None and type(self).feed is CompletionStream.feed
        self.plain: Callable[[dict], Chunk | None] | None = self._read_plain if plain else None
        self.model = self.id = self.created = None
        self.usage: dict | None = None
        self.released: dict[int, list[str]] | None = {} if keep else None
        self.generated: dict[int, list[str]] | None = {} if keep else None

    def probe(self) -> CompletionStream:
        return CompletionStream(None, self._wanted)

    def _finish(self, index: int, reason: str) -> None:
        self.finished[index] = reason
        self.done = len(self.finished) >= self._wanted

    def note(self, data: dict) -> None:
        """What every chunk may carry: the ids, and the usage (the last chunk, after the finish)."""
        self.model = data.get("model") or self.model
        self.id = data.get("id") or self.id
        self.created = data.get("created") or self.created
        if data.get("usage"):
            self.usage = data["usage"]

    def _read_plain(self, data: dict) -> Chunk | None:
        """``feed`` without text steps, without a coroutine (``StreamProtocol.plain``): ``note``
        inline, then the common chunk decided without copying anything: one choice, index 0, whose
        delta object holds nothing but ``role``, ``content`` (a string or null) and a null
        ``refusal`` (OpenAI's role chunk has one). It is forwarded as it came: what the general path
        would build is an equal copy, and its content goes with it (``Chunk.text``: the continuation
        and the encoder read no further); kept texts (``keep``: a keyed request's) get what the
        general path would keep. None: not that shape; ``feed``'s general path decides (and checks
        the shape). One call: this runs for every delta."""
        get = data.get
        self.model = get("model") or self.model
        self.id = get("id") or self.id
        self.created = get("created") or self.created
        usage = get("usage")
        if usage:
            self.usage = usage
        choices = get("choices")
        if not choices:
            return NOTHING
        if type(choices) is not list or len(choices) != 1:
            return None
        choice = choices[0]
        if type(choice) is not dict:
            return None
        index = choice.get("index", 0)
        delta = choice.get("delta")
        reason = choice.get("finish_reason")
        if type(index) is not int or index != 0 or type(delta) is not dict:
            return None
        if not TEXT_DELTA.issuperset(delta) and not (_ROLE_DELTA.issuperset(delta) and delta["refusal"] is None):
            return None
        content = delta.get("content")
        if (content is not None and type(content) is not str) or (reason is not None and type(reason) is not str):
            return None
        if 0 in self.finished:
            return NOTHING  # nothing after a choice's finish_reason is forwarded
        if self.generated is not None:  # as _choice keeps them: without text steps, released is generated
            _kept(self.generated, 0).append(content or "")
        if content and self.released is not None:
            _kept(self.released, 0).append(content)
        if reason:
            self._finish(0, reason)
        return Chunk(data, bool(content or reason), bool(content), (), content)  # positional: per delta

    async def feed(self, data: dict) -> Chunk:
        if self._make_filter is None:
            fed = self._read_plain(data)  # (which notes the chunk)
            if fed is not None:
                return fed
        else:
            self.note(data)
        choices = data.get("choices")
        if not choices:
            return NOTHING
        if not isinstance(choices, list) or not all(map(_well_formed, choices)):
            raise UpstreamMalformed("a chunk's choices are not objects with a delta object")
        kept, substance, finishing = [], False, False
        for choice in choices:
            new = await self._choice(choice)
            if new is not None:
                kept.append(new)
                substance = substance or _has_substance(new["delta"])
                finishing = finishing or bool(new.get("finish_reason"))
        if not kept:
            return NOTHING
        return Chunk({**data, "choices": kept}, output=substance or finishing, delta=substance)

    async def _choice(self, choice: dict) -> dict | None:
        index = choice.get("index", 0)
        if index in self.finished:
            return None  # nothing after a choice's finish_reason is forwarded
        delta = choice.get("delta") or {}
        reason = choice.get("finish_reason")
        if self.generated is not None:
            _kept(self.generated, index).append(_generated(delta))
        if self._make_filter is not None:
            if index not in self._filters:
                self._filters[index] = ChoiceFilters(self._make_filter)
            filtered = await self._filters[index].filter_delta(delta, final=bool(reason))
            if (
                not reason
                and _has_substance(delta)
                and not _has_substance(filtered)
                and set(filtered) <= {*TEXT_FIELDS, "tool_calls"}
            ):
                return None  # everything was held back: nothing to send for this choice
            delta = filtered
        if self.released is not None and delta.get("content"):
            _kept(self.released, index).append(delta["content"])
        if reason:
            self._finish(index, reason)
        return {**choice, "delta": delta}

    def summary(self) -> Done:
        return Done(self.finished.get(0), dict(self.finished), self.usage, self.model, self.id, self.created)


def _kept(texts: dict[int, list[str]], index: int) -> list[str]:
    """Choice ``index``'s kept text (a TextParts, made on its first delta)."""
    kept = texts.get(index)
    if kept is None:
        kept = texts[index] = TextParts()
    return kept


def _generated(delta: dict) -> str:
    """Everything the model generated in a delta: text, refusal and tool-call arguments."""
    parts = [delta.get("content") or "", delta.get("refusal") or ""]
    for call in delta.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            parts.append(function["arguments"])
    return "".join(parts)


async def filter_completion(body: dict, pipeline: Pipeline, record: StreamRecord) -> dict:
    """A whole chat.completion with each choice's texts through the text steps (a new dict)."""
    if not isinstance(body.get("choices"), list):
        raise UpstreamMalformed("the completion is not an object with choices")
    choices = []
    finish_reason = None
    for choice in body["choices"]:
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            choice = {**choice, "message": await _filter_message(choice["message"], pipeline)}
            if choice.get("index", 0) == 0:
                finish_reason = choice.get("finish_reason")
            record.keep_text(choice.get("index", 0), choice["message"].get("content") or "")
        choices.append(choice)
    usage = body.get("usage")
    record.ended(finish_reason, usage if isinstance(usage, dict) else None)
    return {**body, "choices": choices}


async def _whole(pipeline: Pipeline, text: str) -> str:
    text_filter = pipeline.text_filter()
    return await text_filter.feed(text) + await text_filter.flush()


async def _filter_message(message: dict, pipeline: Pipeline) -> dict:
    if not pipeline.filters_text:
        return message
    new = dict(message)
    for field in TEXT_FIELDS:
        if isinstance(message.get(field), str):
            new[field] = await _whole(pipeline, message[field])
    call = message.get("function_call")
    if isinstance(call, dict) and isinstance(call.get("arguments"), str):
        new["function_call"] = {**call, "arguments": await _whole(pipeline, call["arguments"])}
    if isinstance(message.get("tool_calls"), list):
        new["tool_calls"] = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                call = {**call, "function": {**function, "arguments": await _whole(pipeline, function["arguments"])}}
            new["tool_calls"].append(call)
    return new


class CompletionsApi:
    """What the two APIs on the upstream's chat completions share (apis/chat.py, apis/openai_chat.py):
    the upstream call, its stream and its continuation."""

    owns: str | None = None
    path = "/chat/completions"
    known: Callable[[bytes], Known]  # what a resumable stream's stored events told the caller (a takeover's)

    def protocol(self, call: CallRequest, pipeline: Pipeline, keep: bool) -> CompletionStream:
        return CompletionStream(pipeline, call.params.get("n") or 1, keep)

    def continuation(
        self, call: CallRequest, upstreams: Upstreams, protocol: StreamProtocol, record: StreamRecord, most: int
    ) -> ChatContinuation | None:
        if most <= 0 or call.params.get("n") not in (None, 1):
            return None  # with more choices an answer cannot be continued choice by choice: it fails as before
        return ChatContinuation(upstreams, self.path, call.params, protocol, record, most)
