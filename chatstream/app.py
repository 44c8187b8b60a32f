"""The app's parts, built once from the settings for function_app.py (and any other app declaring
its own pipeline): ``create_app(settings, pipeline)`` gives the handler behind each route."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import telemetry, worker_fix
from .apis import chat, openai_chat
from .apis.chat import ChatApi
from .apis.openai_chat import OpenAIChatApi
from .apis.refusals import authenticated
from .apis.responses import ResponsesApi
from .apis.responses_follow_ups import ResponseFollowUps
from .endpoint import Endpoint
from .errors import ApiError, ErrorKind
from .http import with_request_id
from .lifecycle import Lifecycle
from .manage import Manage
from .pipeline import Pipeline
from .resumable import Resumable, encode_error
from .settings import Settings, SettingsError
from .state.accounting import Accounting
from .state.callers import Caller, Team
from .state.shared import SharedState
from .state.streamlog import Claim, ResumeConfig, StreamLog
from .upstreams.failover import Upstreams

log = logging.getLogger("chatstream")


class ChatApp:
    """The handlers behind the routes of function_app.py."""

    def __init__(
        self,
        settings: Settings,
        pipeline: Pipeline,
        upstreams: Upstreams,
        state: SharedState | None,
        lifecycle: Lifecycle | None = None,
    ):
        self.settings = settings
        self.pipeline = pipeline
        self.upstreams = upstreams  # one pool for every endpoint
        self.state = state  # the store every instance shares (AzureWebJobsStorage), when there is one
        accounting = state.accounting if state is not None else None  # CALLER_KEYS=required
        self.streams = _resumable(settings, state, accounting)  # RESUMABLE_STREAMS=on
        # The drain on SIGTERM (lifecycle.py): on_drain() takes the hand-over and the charges; it ends
        # with close().
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle(settings.drain_seconds)
        self.lifecycle.closing(self.close)
        if accounting is not None:
            # What this instance charged goes into the journal, the ledger and the counters now; what
            # does not make it before the host kills the worker, another instance settles from the
            # journal (state/journal.py).
            async def settle_charges() -> None:
                await accounting.flush(within=0.7)

            self.lifecycle.on_drain(settle_charges)
        life = self.lifecycle
        self.chat = Endpoint(ChatApi(), settings, upstreams, pipeline, accounting, self.streams, life)
        self.chat_completions = Endpoint(OpenAIChatApi(), settings, upstreams, pipeline, accounting, self.streams, life)
        if self.streams is not None and settings.continue_on_upstream_failure:
            # A stream whose producer was lost goes on here, on its route's endpoint (endpoint.take_over);
            # with continuations off it cannot (its readers get stream_lost).
            endpoints = {"chat": self.chat, "openai": self.chat_completions}
            streams = self.streams

            async def take_over(claim: Claim) -> None:
                await endpoints[claim.route].take_over(claim)

            streams.streams.on_take_over(take_over)

            async def hand_over() -> None:  # SIGTERM: a reader elsewhere takes each stream over at once
                await streams.streams.drain(timeout=0.7)

            self.lifecycle.on_drain(hand_over)
        # The Responses API: the same pool, each client as Responses calls need it (Azure's v1 paths).
        responses = upstreams.for_responses()
        self.responses = Endpoint(ResponsesApi(), settings, responses, pipeline, accounting, None, life)
        self.response_follow_ups = ResponseFollowUps(settings, responses, pipeline, accounting)
        self.manage = Manage(state)
        self.accounting = accounting
        self.model_names = settings.allowed_models or upstreams.model_names() or (settings.default_model,)
        self.models_listed = bool(settings.allowed_models or upstreams.model_names())  # others are refused

    async def authenticated(self, request: Request) -> tuple[Response | None, tuple[str, ...]]:
        """With caller keys required, a 401 for a request without a valid key (the routes without a
        body: models), else None and the models this caller (and its team) may name."""
        if self.accounting is None:
            return None, self.model_names
        try:
            caller = await authenticated(self.accounting, request.headers)
            team = await self.accounting.registry.team_of(caller)
        except ApiError as error:
            return with_request_id(openai_chat.error_response(error)), ()
        team = team if isinstance(team, Team) else None
        names = _caller_models(self.model_names, self.models_listed, caller)
        return None, tuple(m for m in names if team is None or team.allows(m))

    async def pool_state(self, request: Request) -> Response:
        """GET /api/_pool: each upstream entry's state and counters (never a key)."""
        return with_request_id(JSONResponse(self.upstreams.state(), headers={"Cache-Control": "no-store"}))

    async def models(self, request: Request) -> Response:
        """GET /api/v1/models: the models a caller may name."""
        refused, names = await self.authenticated(request)
        return refused or with_request_id(JSONResponse(openai_chat.models_list(names)))

    async def model(self, request: Request) -> Response:
        """GET /api/v1/models/{model}: one of them, or OpenAI's 404."""
        refused, names = await self.authenticated(request)
        if refused is not None:
            return refused
        name = request.path_params.get("model", "")
        if name in names:
            return with_request_id(JSONResponse(openai_chat.model_object(name)))
        return with_request_id(
            openai_chat.error_response(ApiError(404, ErrorKind.MODEL_NOT_FOUND, f"The model '{name}' does not exist"))
        )

    async def not_found(self, request: Request) -> Response:
        """Any other path under /api/v1/: OpenAI's 404, so SDK callers see a clear NotFoundError."""
        return with_request_id(
            openai_chat.error_response(
                ApiError(404, ErrorKind.NOT_FOUND, f"Invalid URL ({request.method} {request.url.path})")
            )
        )

    async def resume_stream(self, request: Request) -> Response:
        """GET /api/streams/{stream_id}: a resumable stream again, after Last-Event-ID."""
        return with_request_id(await self.streams.resume(request) if self.streams else _streams_off())

    async def cancel_stream(self, request: Request) -> Response:
        """POST /api/streams/{stream_id}/cancel: stop a resumable stream, wherever it is produced."""
        return with_request_id(await self.streams.cancel(request) if self.streams else _streams_off())

    async def close(self) -> None:
        """Close the upstream clients (their connection pools) and the stores, when the app shuts down."""
        await self.upstreams.close()
        if self.streams is not None:
            await self.streams.close()
        if self.state is not None:
            await self.state.close()


def _caller_models(names: tuple[str, ...], listed: bool, caller: Caller) -> tuple[str, ...]:
    """The models a caller may name: the app's that its own list allows; when the app names no list
    of its own (any model goes to the upstream), the caller's list itself."""
    if caller.models is None:
        return names
    if listed:
        return tuple(m for m in names if m in caller.models)
    return caller.models


def _resumable(settings: Settings, state: SharedState | None, accounting: Accounting | None) -> Resumable | None:
    if not settings.resumable_streams:
        return None
    if state is None:
        raise SettingsError(
            "invalid app settings: RESUMABLE_STREAMS=on needs the app's storage: set "
            "AzureWebJobsStorage (locally, make serve starts Azurite for it)"
        )
    encoders = {"chat": chat.encode, "openai": lambda item: openai_chat.encode(item, False)}
    # One store and one instance per process: the stream log beats with the callers' state (instances.py).
    log_ = StreamLog(state.store, state.instances, encode_error(encoders), ResumeConfig.from_settings(settings))
    return Resumable(log_, settings.heartbeat, settings.total_timeout + 60.0, accounting)


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
    lifecycle = Lifecycle.from_settings(settings.drain_seconds, environ)
    return ChatApp(settings, pipeline, upstreams, SharedState.from_settings(settings, environ), lifecycle)
