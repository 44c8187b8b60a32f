"""The upstream: an OpenAI or Azure OpenAI client built from the settings, and its chat stream
read as raw chunks.

The openai SDK does the request: retries (honouring ``retry-after``), timeouts, typed errors, Azure
URLs and Entra ID tokens. The stream's chunks are decoded here with ``json.loads`` instead of the
SDK's typed models: building a ChatCompletionChunk costs ~96 µs per chunk against ~3 µs for
json.loads (measured on this machine), which decides how many streams one worker carries, and raw
dicts keep every field the upstream sent (Azure's filter results, new fields) for pass-through."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai

from .settings import Settings

# Sent when the upstream needs no key (a local vLLM/Ollama/LM Studio behind OPENAI_BASE_URL); the
# SDK refuses to start without one.
NO_KEY = "not-needed"
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"


def make_client(settings: Settings, credential=None) -> openai.AsyncOpenAI:
    """The SDK client for the configured upstream. ``credential`` (an azure-identity async
    credential) is only used for keyless Azure OpenAI; default: DefaultAzureCredential."""
    # The relay enforces first-token, idle and total limits itself; the SDK's read timeout is only
    # a backstop in case a limit is missed, so it sits above both.
    read = max(settings.first_token_timeout, settings.idle_timeout) + 5
    common = dict(max_retries=settings.upstream_max_retries,
                  timeout=openai.Timeout(read, connect=settings.upstream_connect_timeout, write=30.0, pool=30.0))
    if settings.upstream_kind == "azure":
        if settings.azure_openai_api_key is not None:
            auth = {"api_key": settings.azure_openai_api_key.get_secret_value()}
        else:
            auth = {"azure_ad_token_provider": entra_token_provider(credential)}
        # No azure_deployment: the SDK puts the request's model in the URL
        # (/openai/deployments/{model}/...), so a request may name another deployment.
        return openai.AsyncAzureOpenAI(azure_endpoint=settings.azure_openai_endpoint,
                                       api_version=settings.azure_openai_api_version, **auth, **common)
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else NO_KEY
    return openai.AsyncOpenAI(api_key=key, base_url=settings.openai_base_url, **common)


def entra_token_provider(credential=None):
    """An async callable returning a bearer token for Azure OpenAI; azure-identity caches the token
    and refreshes it before it expires."""
    from azure.identity.aio import DefaultAzureCredential, get_bearer_token_provider

    return get_bearer_token_provider(credential or DefaultAzureCredential(), ENTRA_SCOPE)


class UpstreamStream(openai.AsyncStream[dict]):
    """One streamed chat completion: ``async for chunk in stream`` yields each ``data:`` payload
    as a dict until ``[DONE]``; ``close()`` drops the connection (stopping the generation).

    The request goes through the SDK's documented low-level ``client.post`` (retries, timeouts,
    typed errors, Azure's deployment URLs and auth all apply); ``create()`` would first run its
    type-driven transform over the parameters, about 1 ms per request here for plain dicts that
    need none."""

    @classmethod
    async def open(cls, client: openai.AsyncOpenAI, params: dict) -> "UpstreamStream":
        return await client.post("/chat/completions", body=params, cast_to=object, stream=True, stream_cls=cls)

    async def __stream__(self) -> AsyncIterator[dict]:
        framer = SSEFramer()
        try:
            async for piece in self.response.aiter_bytes():
                if framer.done:
                    continue  # read to the end of the body, so the connection can be reused
                for payload in framer.feed(piece):
                    chunk = json.loads(payload)
                    if not isinstance(chunk, dict):
                        raise ValueError("a chunk is not a JSON object")
                    if chunk.get("error") and "choices" not in chunk:
                        raise _stream_error(self.response, chunk["error"])
                    yield chunk
        except _TIMEOUT_ERRORS as exc:
            raise openai.APITimeoutError(request=self.response.request) from exc
        except _TRANSPORT_ERRORS as exc:
            raise openai.APIConnectionError(request=self.response.request) from exc


class SSEFramer:
    """Server-sent events on bytes: ``feed(piece)`` returns the ``data`` of each event completed by
    ``piece`` (data lines joined with LF), up to ``[DONE]``. Lines end with LF, CRLF or CR, also
    when a CRLF is split between pieces; comments, ``event:`` and ``id:`` lines carry nothing for
    chat completions. It works on bytes so that json.loads gets whole UTF-8 text however the network
    split it, and so that no text or line layer costs two more generators per chunk (as httpx's
    would), which matters at thousands of chunks per second."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._cr = False  # the last piece ended with CR: an LF starting the next one belongs to it
        self.done = False

    def feed(self, piece: bytes) -> list[bytes]:
        if not piece:
            return []
        if self._cr and piece.startswith(b"\n"):
            piece = piece[1:]
        self._cr = piece.endswith(b"\r")
        buffer = self._buffer + piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._buffer = buffer.split(b"\n")
        events = []
        for line in lines:
            if line.startswith(b"data:"):
                self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            elif not line and self._data:  # a blank line ends the event
                payload = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                if payload == b"[DONE]":
                    self.done = True
                    break
                events.append(payload)
        return events


def _stream_error(response, error) -> openai.APIError:
    message = error.get("message") if isinstance(error, dict) else None
    return openai.APIError(message if isinstance(message, str) else "An error occurred during streaming",
                           response.request, body=error)


def _http_errors(name: str) -> tuple[type[Exception], ...]:
    # The SDK's HTTP library (httpx2 in openai 3.x, httpx before) raises these while a body is
    # read; the SDK maps them only inside its own decoder, so they are mapped the same way here.
    import importlib
    found = []
    for module in ("httpx2", "httpx"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


_TIMEOUT_ERRORS = _http_errors("TimeoutException")
_TRANSPORT_ERRORS = _http_errors("TransportError")
