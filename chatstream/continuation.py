"""An answer whose upstream fails after output went to the caller goes on on another stream, and
the caller gets every character once (``CONTINUE_ON_UPSTREAM_FAILURE``, docs/pool.md); a
background response of the Responses API is re-attached instead (apis/responses.py).

``ChatContinuation`` is the stream core's ``Continuation`` for a streamed chat completion with one
choice (``/api/chat``, ``/api/v1/chat/completions`` with ``n`` 1):

- **When.** Only after the first output, and only for a failure of the upstream's own
  (``outcomes.may_continue``: a lost connection, a 5xx-shaped error event, the idle limit, undecodable
  data, a body that ended without a finish); never for the total limit, a hang-up, a moderation stop
  or a 4xx-shaped error event. At most ``CONTINUE_MAX`` times per answer. Not while a tool call, a
  legacy function call or a refusal is part of the answer: arguments cannot be continued by prefill,
  so the answer ends with the failure's final error event, as before (every SDK raises on it; none
  is left holding a finished call with a cut JSON argument string).
- **Where.** The next entry in the pool's order that has not failed this answer, then the ones that
  did (so with one entry, the same one), each only when the pool lets it take a request, after its
  cooldown if need be (``Upstreams.open_next``).
- **The request.** The original one plus the text so far (choice 0's content before the text steps)
  as an assistant message. An entry with ``"continue": "prefix"`` (vLLM and other servers with
  ``continue_final_message``) gets that message as a true prefix to extend; any other gets
  ``CONTINUE_PROMPT`` as a user message after it (chat models have no prefill). The output cap
  (``max_tokens``, ``max_completion_tokens``) is lowered by the tokens already generated.
- **The seam** (``Seam``). Models asked to go on often start again (after a " " or a "\n"), repeat
  the last sentence or words, or begin the cut word again. The continuation's first text is held
  while it could still be a repeat (``overlap`` says what counts as one); then the longest repeat
  it starts with is dropped and the rest goes on. The hold is bounded by the length of the text so
  far (and up to ``LEADING_SPACE`` whitespace characters). What it cannot tell: a restart in other words shows
  both wordings, new text that begins with a long enough tail of the old loses it, and a word that
  begins with its own cut fragment ("co" + "conut") loses the fragment. A prefix continuation is
  passed on as it comes. Text steps (the guard) see one text across the seam, on the raw deltas
  after it.
- **The events.** The continuation's chunks keep the answer's ``id`` and ``created``; its role chunk
  is dropped. Its chunk with the ``finish_reason`` and the final event carry ``continued``:
  ``[{"from", "to", "after_chars", "reason", "seam", "dropped"}]`` (``seam``: ``prefix``, the entry
  extended the text, or ``matched``, repeats found by ``overlap`` and ``dropped`` characters of them
  taken out); its usage is the sum of every stream's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from . import telemetry, tokens
from .errors import ApiError
from .record import Segment, StreamRecord, TextParts
from .stream import Chunk, Done, Hands, StreamProtocol, TimeLimits, UpstreamChunks
from .upstreams.outcomes import may_continue

if TYPE_CHECKING:
    from .upstreams.config import Entry
    from .upstreams.failover import Upstreams

log = logging.getLogger("chatstream")

# A caller turns continuations off for one request with this header set to ``off``.
HEADER = "x-chatstream-continue"
# What a chat model without prefill is told after the text so far.
CONTINUE_PROMPT = (
    "Your previous reply was cut off. Continue it exactly where it stopped: write only the rest, "
    "starting with the very next character, without repeating anything already written and "
    "without any remark about the interruption."
)
# A repeat shorter than this is not taken for one (unless it is the whole text so far, or the cut word
# joined at its start, ``overlap``): a continuation that starts with a few characters the text so far
# ends with is more likely new text.
MIN_OVERLAP = 8
# Whitespace a continuation may start with before it repeats the text so far (models asked to go on
# often start again after a " " or a "\n"): read past, and dropped with the repeat.
LEADING_SPACE = 4


def turned_off(headers) -> bool:
    """The request asks for no continuation (``x-chatstream-continue: off``)."""
    return (headers.get(HEADER) or "").strip().lower() in ("off", "false", "0", "no")


# --- the seam ---------------------------------------------------------------------------------


def overlap(known: str, text: str) -> int:
    """How many leading characters of ``text`` repeat the end of ``known``, the longest of:

    - a suffix of ``known`` that ``text`` starts with, when it is all of ``known``, at least
      ``MIN_OVERLAP`` characters, or, when ``known`` ends in a word, starts at a word's start (the cut
      word again: "were pl" + "playing", "the cat" + "cat sat");
    - up to ``LEADING_SPACE`` whitespace characters and then all of ``known`` or a suffix of at least
      ``MIN_OVERLAP`` characters (a model that starts again on a new line).

    Else 0."""
    best = _repeat(known, text, words=True)
    for lead in range(1, _leading_space(text) + 1):
        again = _repeat(known, text[lead:], words=False) if len(text) > lead else 0
        if again:
            best = max(best, lead + again)
    return best


def _leading_space(text: str) -> int:
    """How many whitespace characters ``text`` starts with, up to ``LEADING_SPACE``."""
    return len(text[:LEADING_SPACE]) - len(text[:LEADING_SPACE].lstrip())


def _repeat(known: str, text: str, words: bool) -> int:
    """The longest suffix of ``known`` that ``text`` starts with and that counts as a repeat
    (``overlap``, without the leading whitespace)."""
    if known and text.startswith(known):
        return len(known)
    n = min(len(known), len(text))
    if n >= MIN_OVERLAP:
        probe = text[:MIN_OVERLAP]
        at = known.find(probe, len(known) - n)
        while at != -1:  # the first fitting start is the longest suffix
            if text.startswith(known[at:]):
                return len(known) - at
            at = known.find(probe, at + 1)
    if words and known and _word(known[-1]):
        for size in range(min(n, MIN_OVERLAP - 1), 0, -1):
            at = len(known) - size
            if _word_start(known, at) and text.startswith(known[at:]):
                return size
    return 0


def _word(char: str) -> bool:
    return char.isalnum()


def _word_start(known: str, at: int) -> bool:
    return _word(known[at]) and (at == 0 or not _word(known[at - 1]))


def _could_grow(known: str, held: str, words: bool) -> bool:
    """Whether ``held`` is the start of a suffix of ``known`` longer than itself that counts as a
    repeat (``_repeat``): if so the continuation may still turn out to repeat it."""
    end = len(known) - 1  # a match must end before known's last character
    at = known.find(held, 0, end)
    if at == -1:
        return False
    if at == 0 or len(known) - at >= MIN_OVERLAP:
        return True
    if not (words and _word(known[-1])):
        return False
    while at != -1:  # the rest are all in the last MIN_OVERLAP characters
        if _word_start(known, at):
            return True
        at = known.find(held, at + 1, end)
    return False


class Seam:
    """Where a continuation's text meets the text so far (``known``). ``feed`` takes each piece of
    the continuation's text with what carries it (a chunk) and returns the pieces to pass on, each
    with the text it now carries: while the continuation so far could still become a longer repeat
    (``overlap``), everything is held; then the repeated part is dropped and the rest passed on.
    ``final``: nothing more comes (the answer finished, or something else than text follows): decide
    now. With ``dedupe`` off (a true prefix continuation) everything passes at once."""

    def __init__(self, known: str, dedupe: bool = True):
        self.known = known
        self.dedupe = dedupe
        self.deciding = dedupe and bool(known)
        self.dropped = 0  # characters dropped as a repeat
        self._held: list[tuple[object, str]] = []
        self._text = ""

    @property
    def holding(self) -> int:
        """Characters held now."""
        return len(self._text)

    def feed(self, carrier: object, text: str, final: bool = False) -> list[tuple[object, str]]:
        if not self.deciding:
            return [(carrier, text)]
        self._held.append((carrier, text))
        self._text += text
        if not final and self._could_grow():
            return []
        return self._decide()

    def _could_grow(self) -> bool:
        """Whether the held text may still turn out to be a longer repeat (``overlap``): it starts a
        longer suffix of ``known`` that would count, as it is or after its leading whitespace."""
        known, held = self.known, self._text
        if _could_grow(known, held, words=True):
            return True
        return any(
            len(held) == lead or _could_grow(known, held[lead:], words=False)
            for lead in range(1, _leading_space(held) + 1)
        )

    def _decide(self) -> list[tuple[object, str]]:
        drop = self.dropped = overlap(self.known, self._text)
        out = []
        for carrier, text in self._held:
            if drop >= len(text):
                drop -= len(text)
                if text:
                    continue  # all of it was a repeat
            else:
                text, drop = text[drop:], 0
            out.append((carrier, text))
        self._held, self._text, self.deciding = [], "", False
        return out


# --- usage ------------------------------------------------------------------------------------


def add_usage(total: dict | None, usage: dict | None) -> dict | None:
    """Two usage objects added up: their numbers summed (nested ``*_details`` too); anything else
    kept from the first that has it."""
    if not isinstance(usage, dict):
        return total
    if total is None:
        return dict(usage)
    out = dict(total)
    for key, value in usage.items():
        mine = out.get(key)
        if _number(value) and (_number(mine) or mine is None):
            out[key] = (mine or 0) + value
        elif isinstance(value, dict) and (isinstance(mine, dict) or mine is None):
            out[key] = add_usage(mine, value)
        elif mine is None:
            out[key] = value
    return out


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- chat completions -------------------------------------------------------------------------


def continuation_request(params: dict, text: str, entry: Entry) -> dict:
    """The continuation of ``params`` on ``entry``, after ``text`` (see the module docstring).
    Without any text (a stream taken over from a log that holds none of the answer) it is the
    request as it was: an empty assistant turn and an instruction to go on make models answer the
    instruction instead."""
    if not text:
        return dict(params)
    messages = [*params["messages"], {"role": "assistant", "content": text}]
    request = {**params, "messages": messages}
    if entry.continuation == "prefix":
        request["continue_final_message"] = True
        request["add_generation_prompt"] = False
    else:
        messages.append({"role": "user", "content": CONTINUE_PROMPT})
    spent = None
    for field in tokens.CAP_FIELDS:
        cap = params.get(field)
        if type(cap) is int and cap > 0:
            spent = tokens.count_text(params.get("model"), text) if spent is None else spent
            request[field] = max(1, cap - spent)
    return request


_SUBSTANCE = ("tool_calls", "function_call", "refusal")
TEXT_DELTA = frozenset({"role", "content"})  # a chat delta of text alone: blocks no continuation, read plain


class ChatContinuation:
    """The stream core's ``Continuation`` for one streamed chat completion with one choice."""

    def __init__(
        self,
        upstreams: Upstreams,
        path: str,
        params: dict,
        protocol: StreamProtocol,
        record: StreamRecord,
        most: int,
    ):
        self.upstreams = upstreams
        self.path = path
        self.params = params
        self.protocol = protocol
        self.record = record
        self.most = most
        # choice 0's content so far, as the protocol got it (raw); None: the first stream's, which is
        # its segment's text (kept once)
        self._passed: TextParts | None = None
        self._blocked: str | None = None  # what the answer holds that cannot be continued
        self._segment: Segment | None = None
        self._failed: set[str] = set()
        self._seam: Seam | None = None  # on a continuation: its seam with the text so far
        self._id: object = None  # the answer's id and created, from its first stream
        self._created: object = None
        self._lost: ApiError | None = None  # a takeover: what lost the answer (``open``)
        # The caller has its role chunk (the first stream's, or a taken-over log's): a continuation's
        # is dropped. A takeover from a log without it passes the continuation's, as event 1 (chat
        # completions number it: the ids must name the same event on every instance).
        self._role_sent = True

    @classmethod
    def resuming(
        cls,
        upstreams: Upstreams,
        path: str,
        params: dict,
        protocol: StreamProtocol,
        record: StreamRecord,
        most: int,
        known: Known,
        lost: ApiError,
    ) -> ChatContinuation:
        """The continuation of an answer another instance began and lost (a takeover): the caller
        has ``known``; it is also the stream core's ``Upstream`` for it, whose first stream (``open``)
        is already a continuation after ``known``, on ``lost``; ``most`` more may follow."""
        plan = cls(upstreams, path, params, protocol, record, most + 1)
        plan._passed = TextParts([known.text])
        plan._id, plan._created = known.id, known.created
        plan._lost = lost
        plan._role_sent = known.role_sent
        return plan

    async def open(
        self, path: str, params: dict, protocol: StreamProtocol, limits: TimeLimits, record: StreamRecord
    ) -> UpstreamChunks:
        assert self._lost is not None, "only a takeover's continuation is its Upstream (``resuming``)"
        return await self.reopen(self._lost, limits)

    # -- every chunk
    def hands(self) -> Hands:
        """A continuation's stream goes through the seam (``feed``); the first's is passed on as it
        comes (``saw``)."""
        return (self.feed, None) if self._seam is not None else (None, self.saw)

    def saw(self, data: dict, fed: Chunk) -> None:
        """A chunk of the first stream, after the protocol: when it read choice 0's text of the chunk
        as it came (``fed.text``: its plain chunk), that text is all this needs of it besides the ids
        (its usage is the protocol's: ``reopen``); else the chunk is read here."""
        text = fed.text
        if text is None:
            choice, _, text = self._look(data)
            if choice is None:
                return
        else:
            segment = self._segment or self._first_segment()
            if text:
                segment.parts.append(text)
        if self._id is None:
            self._id, self._created = data.get("id"), data.get("created")
        if text and self._passed is not None:  # a takeover's first stream: after what the log held
            self._passed.append(text)

    def feed(self, data: dict) -> Sequence[dict]:
        """A chunk of a continuation's stream, before the protocol: through the seam."""
        choice, delta, content = self._look(data)
        if choice is None or delta is None:  # no choice (a usage frame), or the protocol's to judge
            return (self._named(data),)
        return self._across(data, choice, delta, content)

    def _first_segment(self) -> Segment:
        segment = self._segment = Segment(
            self.record.upstream, request_id=self.record.request_id or None, model=self.record.upstream_model
        )
        return segment

    def _look(self, data: dict) -> tuple[dict | None, dict | None, str]:
        """What of a chunk this keeps (its segment's text and usage, whether the answer holds what
        cannot be continued), and its one choice, that choice's delta and content ("" for none);
        the choice None when the chunk has no one choice with a delta object."""
        segment = self._segment or self._first_segment()
        usage = data.get("usage")
        if usage and isinstance(usage, dict):
            segment.usage = usage
        choices = data.get("choices")
        choice = choices[0] if type(choices) is list and len(choices) == 1 else None
        delta = choice.get("delta") if type(choice) is dict else None
        if choice is None or type(delta) is not dict:
            return None, None, ""
        content = delta.get("content")
        if type(content) is not str:
            content = ""
        elif content:
            segment.parts.append(content)
        if (
            self._blocked is None
            and not TEXT_DELTA.issuperset(delta)  # one look for the common delta, not three
            and (delta.get("tool_calls") or delta.get("function_call") or delta.get("refusal"))
        ):
            self._blocked = next(name for name in _SUBSTANCE if delta.get(name))
        return choice, delta, content

    def _across(self, data: dict, choice: dict, delta: dict, content: str) -> list[dict]:
        """A chunk of a continuation: through the seam, with the answer's id."""
        seam = self._seam
        assert seam is not None
        finish = choice.get("finish_reason")
        other = any(delta.get(name) for name in _SUBSTANCE)
        if not content and not finish and not other:
            if self._role_sent or not delta.get("role"):
                return []  # its role chunk, or nothing at all: the caller has had its role
            self._role_sent = True
            return [self._named(data)]
        pieces: list[tuple[object, str]] = []
        if other and seam.deciding:  # something else than text: decide on the text held so far
            pieces = seam.feed(None, "", final=True)
        pieces += seam.feed(data, content, final=bool(finish or other))
        if pieces and seam.dedupe:  # decided: what it dropped goes in the answer's ``continued``
            self.record.continued[-1]["dropped"] = seam.dropped
        out = []
        for carrier, text in pieces:
            if not isinstance(carrier, dict):
                continue
            out.append(self._rebuilt(carrier, text))
            if text and self._passed is not None:
                self._passed.append(text)
        return out

    def _rebuilt(self, data: dict, text: str) -> dict:
        choice = data["choices"][0]
        delta = choice["delta"]
        if (delta.get("content") or "") != text:
            dropped = len(delta.get("content") or "") - len(text)
            choice = {**choice, "delta": {**delta, "content": text}}
            if isinstance(choice.get("logprobs"), dict):
                choice["logprobs"] = _trimmed_logprobs(choice["logprobs"], dropped)
        new = self._named({**data, "choices": [choice]})
        if choice.get("finish_reason"):
            new["continued"] = list(self.record.continued)
        return new

    def _named(self, data: dict) -> dict:
        """A continuation's chunk with the answer's id and created (a new dict)."""
        new = dict(data)
        if self._id is not None:
            new["id"] = self._id
        if self._created is not None:
            new["created"] = self._created
        return new

    def note(self, data: dict) -> None:
        usage = data.get("usage")
        if self._segment is not None and usage and isinstance(usage, dict):
            self._segment.usage = usage

    # -- a failure
    def may_continue(self, error: ApiError) -> bool:
        if not may_continue(error) or len(self.record.continued) >= self.most:
            return False
        if self._blocked is not None:
            log.info("an answer with a %s in it is not continued after %s", self._blocked, error.type)
            return False
        return True

    async def reopen(self, error: ApiError, limits: TimeLimits) -> UpstreamChunks:
        record, ended = self.record, self._segment
        failed = ended.upstream if ended is not None else record.upstream
        if failed is not None:
            self._failed.add(failed)
        if self._passed is None:  # the first stream failed: the text so far is its segment's
            self._passed = TextParts([ended.text] if ended is not None else [])
        if ended is not None and self._seam is None:  # the first stream's usage, as its protocol read it
            usage = self.protocol.usage
            ended.usage = usage if isinstance(usage, dict) else None
        known = "".join(self._passed)
        sent: list[dict] = []  # the request each entry tried was sent: the last one answered

        def request(entry: Entry) -> dict:
            sent.append(continuation_request(self.params, known, entry))
            return sent[-1]

        stream = await self.upstreams.open_next(
            self.path, self.params["model"], request, self.protocol, limits, record, self._failed
        )
        entry = stream.entry
        self._seam = Seam(known, dedupe=entry is None or entry.continuation != "prefix")
        self._segment = Segment(
            entry.name if entry is not None else None,
            request_id=stream.request_id,
            prompt_tokens=tokens.count_prompt(self.params.get("model"), sent[-1]) if sent else None,
            model=entry.deployment(self.params["model"]) if entry is not None else None,
        )
        if ended is not None and not record.segments:  # the first stream's: one of several now
            record.segment(ended)
        record.segment(self._segment)
        seam = {
            "from": failed,
            "to": self._segment.upstream,
            "after_chars": len(known),
            "reason": str(error.type),
            "seam": "matched" if self._seam.dedupe else "prefix",
            "dropped": 0,
        }
        record.continued_on(seam)
        telemetry.upstream_event("continuations", failed or "", reason=str(error.type))
        log.info(
            "upstream %s: %s after %d characters; the answer goes on on %s",
            failed,
            error.type,
            len(known),
            self._segment.upstream,
        )
        return stream

    # -- the end
    def summary(self, done: Done) -> Done:
        if not self.record.continued:
            return done
        usage = None
        for segment in self.record.segments:
            usage = add_usage(usage, segment.usage)
        return replace(
            done,
            usage=usage,
            continued=tuple(self.record.continued),
            id=self._id if isinstance(self._id, str) else done.id,
            created=self._created if isinstance(self._created, int) else done.created,
        )


def _trimmed_logprobs(logprobs: dict, dropped: int) -> dict:
    """A chunk's logprobs without the tokens of the ``dropped`` characters it no longer carries."""
    content = logprobs.get("content")
    if not isinstance(content, list):
        return logprobs
    kept, skipped = list(content), 0
    while kept and isinstance(kept[0], dict) and isinstance(kept[0].get("token"), str):
        size = len(kept[0]["token"])
        if skipped + size > dropped:
            break
        skipped += size
        kept.pop(0)
    return {**logprobs, "content": kept}


@dataclass(frozen=True)
class Known:
    """What a stream stored before its producer was lost (a takeover, resumable.py): choice 0's text,
    the answer's id and created, and what part of it cannot be continued (a tool call...), if any."""

    text: str
    id: str | None = None
    created: int | None = None
    blocked: str | None = None
    role_sent: bool = True  # chat completions: the stored chunks hold the role chunk


def known_from_chunks(chunks: Sequence[dict]) -> Known:
    """``Known`` from chat.completion.chunks as the stream passed them on."""
    text, answer_id, created, blocked, role_sent = [], None, None, None, False
    for chunk in chunks:
        answer_id = answer_id or (chunk.get("id") if isinstance(chunk.get("id"), str) else None)
        created = created or (chunk.get("created") if isinstance(chunk.get("created"), int) else None)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            role_sent = role_sent or bool(delta.get("role"))
            if isinstance(delta.get("content"), str):
                text.append(delta["content"])
            blocked = blocked or next((name for name in _SUBSTANCE if delta.get(name)), None)
    return Known("".join(text), answer_id, created, blocked, role_sent)
