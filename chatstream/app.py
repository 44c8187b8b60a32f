"""The app's parts, built once from the settings for function_app.py (and any other app declaring
its own pipeline): ``create_app(settings, pipeline)`` gives the handler behind each route."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import telemetry, tokens, worker_fix
from .apis import chat, openai_chat
from .apis.chat import ChatApi
from .apis.openai_chat import OpenAIChatApi
from .apis.refusals import authenticated, error
from .apis.responses import ResponsesApi
from .apis.responses_follow_ups import ResponseFollowUps
from .endpoint import Endpoint
from .errors import ApiError, ErrorKind
from .http import NO_STORE, with_request_id
from .lifecycle import HOST_DEFAULT_SHUTDOWN, Lifecycle, host_shutdown_timeout
from .manage import Manage
from .pipeline import Pipeline
from .resumable import Resumable, encode_error
from .settings import Settings
from .state.port import Unavailable, Unreadable
from .state.shared import SharedState
from .state.streamlog.log import StreamLog, TakeOverHook
from .state.streamlog.takeover import Claim
from .upstreams.failover import Upstreams

log = logging.getLogger("chatstream")


class ChatApp:
    """The handlers behind the routes of function_app.py (whose docstrings say what each answers)."""

    def __init__(
        self,
        settings: Settings,
        pipeline: Pipeline,
        upstreams: Upstreams,
        state: SharedState | None,
        host_timeout: float = HOST_DEFAULT_SHUTDOWN,
        signals: bool = True,
    ):
        self.settings = settings
        self.pipeline = pipeline
        self.upstreams = upstreams  # one pool for every endpoint
        self.state = state  # the store every instance shares (AzureWebJobsStorage), when there is one
        # With CALLER_KEYS=required: callers' keys, limits and charges; callers and teams.
        self.accounting = accounting = state.accounting if state is not None else None
        self.registry = registry = state.registry if state is not None and accounting is not None else None
        # RESUMABLE_STREAMS=on. A stream whose producer was lost goes on here, on its route's
        # endpoint (take_over); with continuations off it cannot (its readers get stream_lost).
        continues = settings.continue_on_upstream_failure
        self.stream_log = _stream_log(state, self.take_over if continues else None)
        self.streams = Resumable(self.stream_log, settings.heartbeat, accounting) if self.stream_log else None
        # The drain on SIGTERM (lifecycle.py): at the grace's end what this instance charged goes
        # into the journal, the ledger and the counters (what does not make it before the host kills
        # the worker, another instance settles from the journal: state/journal.py), and a reader
        # elsewhere takes each resumable stream still running here over at once; then the app closes.
        drain_steps = []
        if accounting is not None:
            drain_steps.append(functools.partial(accounting.flush, within=0.7))
        if self.stream_log is not None and continues:
            drain_steps.append(functools.partial(self.stream_log.drain, timeout=0.7))
        moving = [self.stream_log.move_readers] if self.stream_log is not None else []
        self.lifecycle = life = Lifecycle(
            settings.drain_seconds,
            host_timeout,
            on_drain=drain_steps,
            closing=[self.close],
            on_draining=moving,
            signals=signals,
        )
        self.chat = Endpoint(ChatApi(), settings, upstreams, pipeline, accounting, self.streams, life, registry)
        self.chat_completions = Endpoint(
            OpenAIChatApi(), settings, upstreams, pipeline, accounting, self.streams, life, registry
        )
        # The Responses API: the same pool, each client as Responses calls need it (Azure's v1 paths).
        responses = upstreams.for_responses()
        self.responses = Endpoint(ResponsesApi(), settings, responses, pipeline, accounting, None, life)
        self.response_follow_ups = ResponseFollowUps(settings, responses, pipeline, accounting)
        self.manage = Manage(state)
        self.model_names = settings.allowed_models or upstreams.model_names() or (settings.default_model,)
        self.models_listed = bool(settings.allowed_models or upstreams.model_names())  # others are refused

    async def take_over(self, claim: Claim) -> None:
        await (self.chat if claim.producer.route == "chat" else self.chat_completions).take_over(claim)

    async def _models(self, request: Request) -> tuple[str, ...]:
        """The models the request's caller may name: the app's (its caller's list itself when the app
        names none: any model goes to the upstream) that the caller and its team allow; with caller
        keys required, the ApiError that refuses it as a model route would (401, 503)."""
        if self.accounting is None or self.registry is None:
            return self.model_names
        caller = await authenticated(self.accounting, request.headers)
        terms = await self.registry.terms(caller)
        if isinstance(terms, Unavailable | Unreadable):
            raise error(terms)
        team = terms[0]
        names = self.model_names if self.models_listed or caller.models is None else caller.models
        return tuple(m for m in names if caller.allows(m) and (team is None or team.allows(m)))

    async def pool_state(self, request: Request) -> Response:
        return with_request_id(JSONResponse(self.upstreams.state(), headers=NO_STORE))

    async def models(self, request: Request) -> Response:
        try:
            return with_request_id(JSONResponse(openai_chat.models_list(await self._models(request))))
        except ApiError as refused:
            return with_request_id(openai_chat.error_response(refused))

    async def model(self, request: Request) -> Response:
        name = request.path_params.get("model", "")
        try:
            if name not in await self._models(request):
                raise ApiError(404, ErrorKind.MODEL_NOT_FOUND, f"The model '{name}' does not exist")
            return with_request_id(JSONResponse(openai_chat.model_object(name)))
        except ApiError as refused:
            return with_request_id(openai_chat.error_response(refused))

    async def not_found(self, request: Request) -> Response:
        return with_request_id(
            openai_chat.error_response(
                ApiError(404, ErrorKind.NOT_FOUND, f"Invalid URL ({request.method} {request.url.path})")
            )
        )

    async def resume_stream(self, request: Request) -> Response:
        """An instance that serves only readers drains on SIGTERM too (its readers move: lifecycle.py)."""
        self.lifecycle.install()
        return with_request_id(await self.streams.resume(request) if self.streams else _streams_off())

    async def cancel_stream(self, request: Request) -> Response:
        return with_request_id(await self.streams.cancel(request) if self.streams else _streams_off())

    async def close(self) -> None:
        """Close the upstream clients (their connection pools) and the stores, when the app shuts down."""
        await self.upstreams.close()
        if self.stream_log is not None:
            await self.stream_log.close()  # its store and instance are the shared state's, closed with it
        if self.state is not None:
            await self.state.close()


def _stream_log(state: SharedState | None, take_over: TakeOverHook | None) -> StreamLog | None:
    if state is None or state.resume is None:  # without storage: refused at start-up (shared.py)
        return None
    encoders = {"chat": chat.encode, "openai": lambda item: openai_chat.encode(item, False)}
    # One store and one instance per process: the stream log beats with the callers' state (instances.py).
    return StreamLog(state.store, state.instances, encode_error(encoders), state.resume, take_over)


def _told(route: str, events: bytes) -> str:
    """The text a resumable stream's stored events (of ``route``) sent its caller: what a dead
    instance's recovery charges at least (state/journal.py)."""
    return (ChatApi() if route == "chat" else OpenAIChatApi()).known(events).text


def _streams_off() -> Response:
    return openai_chat.error_response(
        ApiError(404, ErrorKind.NOT_FOUND, "resumable streams are off (RESUMABLE_STREAMS)")
    )


def create_app(
    settings: Settings,
    pipeline: Pipeline | None = None,
    environ: Mapping[str, str] | None = None,
    credential: Any = None,
) -> ChatApp:
    """The app's handlers: ``UPSTREAMS`` when set (a bad value raises SettingsError), else the single
    upstream. ``environ``: where the keys UPSTREAMS names are read (default: the process
    environment); ``credential``: an azure-identity async credential for Entra ID (default:
    DefaultAzureCredential)."""
    worker_fix.apply()  # the Python worker's per-request leak (worker_fix.py); only inside that worker
    if not settings.upstream_configured:
        log.warning("no upstream configured: set UPSTREAMS, OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
    pipeline = pipeline if pipeline is not None else Pipeline.from_settings(settings)
    environ = os.environ if environ is None else environ
    upstreams = Upstreams.from_settings(settings, environ, credential=credential)
    if upstreams.pooled:
        telemetry.watch_probes(upstreams.pool.probes)
        log.info(
            "upstream pool: %s",
            ", ".join(f"{e.name} (priority {e.priority}, weight {e.weight:g})" for e in upstreams.pool.entries),
        )
    state = SharedState.from_settings(settings, environ, told=_told)
    if state is not None and state.accounting is not None:
        # o200k_base's tables (every current model's) off the first request's path; a model of
        # another family builds its own on first use (tokens.py).
        threading.Thread(target=tokens.preload, name="tokenizer-preload", daemon=True).start()
    return ChatApp(settings, pipeline, upstreams, state, host_shutdown_timeout(environ))
