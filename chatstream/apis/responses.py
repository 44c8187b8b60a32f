"""POST /api/v1/responses: OpenAI's Responses API, for the OpenAI SDKs' ``client.responses``, the
Agents SDK and the Vercel AI SDK's default ``openai()`` provider (docs/openai.md, "Responses"). Its
request contract, the adapter the endpoint uses and a background stream's re-attachment; the stream
itself is responses_stream.py, the calls about a stored response (GET, DELETE, cancel, input_items)
responses_follow_ups.py.

Forward-compatible like chat completions: the relay checks the fields it reads (``model``,
``input``, ``instructions``, ``stream``, ``background``, ``tools``) and the types of OpenAI's others
(fields.py); every field goes to the upstream unchanged. Errors are OpenAI's (openai_chat.error_response).

Background responses (``"background": true``): a caller hanging up closes the upstream stream, as for
any stream, and sends no cancel request, so the response goes on at the upstream: resume it with
``GET /api/v1/responses/{id}?stream=true&starting_after=N`` or cancel it with
``POST /api/v1/responses/{id}/cancel``. A foreground stream's upstream is closed, stopping the
generation, when the caller hangs up.

Azure OpenAI: the calls go to Azure's v1 API, ``{AZURE_OPENAI_ENDPOINT}/openai/v1/responses``, with the
deployment name as ``model`` in the body and no ``api-version`` (upstreams/clients.ResponsesClient)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any

from pydantic import Field, StrictBool

from .. import telemetry
from ..errors import ApiError, ErrorKind
from ..http import validate_object
from ..pipeline import CallRequest, Pipeline
from ..record import StreamRecord
from ..stream import Done, Hands, StreamProtocol, TimeLimits, UpstreamChunks
from ..upstreams.failover import Upstreams
from ..upstreams.outcomes import may_continue
from .fields import ResponsesFields, type_problem
from .openai_chat import describe, error_response, passed_on
from .responses_stream import TERMINAL, ResponseEncoder, ResponseStream, filter_response

log = logging.getLogger("chatstream")


class ResponsesRequest(ResponsesFields):
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    stream: StrictBool | None = None
    background: StrictBool | None = None


def _describe(first: dict) -> tuple[str, str | None]:
    problem = type_problem(ResponsesRequest, first)
    if problem is not None:
        return problem
    message, param = describe(first)
    if param == "input":  # pydantic's union message would list its branches
        message = "input: must be a string or an array of input items"
    return message, param


class ResponsesApi:
    name = "responses"
    owns: str | None = "response"  # a stored or background response is its caller's (follow-ups check it)
    path = "/responses"
    completes = True

    def parse(self, data: object, default_model: str) -> CallRequest:
        validate_object(ResponsesRequest, data, _describe)
        return CallRequest(params=passed_on(data, default_model), endpoint=self.name)

    def protocol(self, call: CallRequest, pipeline: Pipeline, keep: bool) -> ResponseStream:
        return ResponseStream(pipeline, keep=keep)

    def encoder(self, call: CallRequest) -> ResponseEncoder:
        return ResponseEncoder()

    error_response = staticmethod(error_response)
    completion = staticmethod(filter_response)

    def continuation(
        self, call: CallRequest, upstreams: Upstreams, protocol: StreamProtocol, record: StreamRecord, most: int
    ) -> ResponsesReattach | None:
        if most <= 0 or call.params.get("background") is not True:
            return None
        return ResponsesReattach(upstreams, record, most)


class ResponsesReattach:
    """The stream core's ``Continuation`` for a streamed background response: it goes on at its
    entry whatever happens to our connection, so a connection lost (or silent past the idle limit,
    or ended early) is re-attached with ``GET /responses/{id}?stream=true&starting_after=N`` on that
    same entry, N the last ``sequence_number`` passed on. Nothing is repeated, so there is no seam to
    mend: an event at or before N is dropped all the same. The terminal event carries ``continued``.
    Any other response is not continued (a foreground one stops when its stream does, and chat
    models have no prefill for a Responses ``input`` either)."""

    def __init__(self, upstreams: Upstreams, record: StreamRecord, most: int):
        self.upstreams = upstreams
        self.record = record
        self.most = most
        self._last = -1  # the last sequence_number passed on
        self._id: str | None = None
        self._chars = 0  # text passed on (output_text deltas)

    def hands(self) -> Hands:
        return self.feed, None  # every stream's events are checked against the last one passed on

    def feed(self, data: dict) -> Sequence[dict]:
        number = data.get("sequence_number")
        if isinstance(number, int) and not isinstance(number, bool):
            if number <= self._last:
                return ()  # already passed on
            self._last = number
        response = data.get("response")
        if self._id is None and isinstance(response, dict) and isinstance(response.get("id"), str):
            self._id = response["id"]
        if data.get("type") == "response.output_text.delta" and isinstance(data.get("delta"), str):
            self._chars += len(data["delta"])
        if self.record.continued and data.get("type") in TERMINAL:
            return ({**data, "continued": list(self.record.continued)},)
        return (data,)

    def note(self, data: dict) -> None:
        pass

    def may_continue(self, error: ApiError) -> bool:
        return (
            self._id is not None
            and len(self.record.continued) < self.most
            and may_continue(error)
            and error.type != ErrorKind.UPSTREAM_ERROR  # an error event: the response itself failed
        )

    async def reopen(self, error: ApiError, limits: TimeLimits) -> UpstreamChunks:
        record = self.record
        entry = record.upstream
        assert entry is not None and self._id is not None
        query = {"stream": "true", "starting_after": str(self._last)}
        probe = ResponseStream(None, resumed=True)  # a re-stream's deltas are only the end of each text
        stream = await self.upstreams.reattach(entry, f"/responses/{self._id}", query, probe)
        seam = {"from": entry, "to": entry, "after_chars": self._chars, "reason": str(error.type)}
        record.continued_on(seam)
        telemetry.upstream_event("continuations", entry, reason=str(error.type))
        log.info("upstream %s: %s; background response re-attached after event %d", entry, error.type, self._last)
        return stream

    def summary(self, done: Done) -> Done:
        continued = self.record.continued
        return replace(done, continued=tuple(continued)) if continued else done
