"""POST /api/v1/responses: OpenAI's Responses API, for the OpenAI SDKs' ``client.responses``, the
Agents SDK and the Vercel AI SDK's default ``openai()`` provider (docs/openai.md, "Responses"). Its
request contract and the adapter the endpoint uses; the stream itself is responses_stream.py, the
calls about a stored response (GET, DELETE, cancel, input_items) responses_follow_ups.py.

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

from typing import Annotated, Any

from pydantic import Field, StrictBool

from ..continuation import ResponsesReattach
from ..http import validate_object
from ..pipeline import CallRequest, Pipeline
from ..record import StreamRecord
from ..stream import StreamProtocol
from ..upstreams.failover import Upstreams
from .fields import ResponsesFields, type_problem
from .openai_chat import describe, error_response, passed_on
from .responses_stream import ResponseEncoder, ResponseStream, filter_response


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


def validate(data: object) -> ResponsesRequest:
    return validate_object(ResponsesRequest, data, _describe)


class ResponsesApi:
    name = "responses"
    owns: str | None = "response"  # a stored or background response is its caller's (follow-ups check it)
    path = "/responses"
    completes = True

    def parse(self, data: object, default_model: str) -> CallRequest:
        validate(data)
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
        """A background response's stream is re-attached where it dropped; no other is continued."""
        if most <= 0 or call.params.get("background") is not True:
            return None
        return ResponsesReattach(upstreams, lambda: ResponseStream(None, resumed=True), record, most)
