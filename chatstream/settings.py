"""App settings: environment variables (Azure app settings, or local.settings.json locally),
read and validated once at start-up into one typed object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

# How RESUMABLE_STREAMS may be spelled, in any case: tools/scripts/serve reads it through Settings too,
# so the two agree on what turns it on.
SWITCH_ON = ("on", "true", "1", "yes")
SWITCH_OFF = ("off", "false", "0", "no")


# UPSTREAM_ERROR_ROUTES: what a pool does after an upstream error that says nothing about the
# entry's health, per class: ``next`` (the next candidate), ``larger`` (only entries declaring a
# larger context_window), ``stop`` (that error is the answer). The defaults, and why, in docs/pool.md.
ERROR_ROUTES = {"context_length": "larger", "content_filter": "stop", "auth": "next", "quota": "next"}
_ROUTE_ACTIONS = {"context_length": ("larger", "next", "stop")}


def parse_error_routes(value: str) -> dict[str, str]:
    """``context_length=next, content_filter=next`` → a dict; ValueError naming what is wrong."""
    routes: dict[str, str] = {}
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        name, _, action = (s.strip().lower() for s in part.partition("="))
        if name not in ERROR_ROUTES:
            raise ValueError(f"unknown error class {name!r}: use {', '.join(ERROR_ROUTES)}")
        allowed = _ROUTE_ACTIONS.get(name, ("next", "stop"))
        if action not in allowed:
            raise ValueError(f"{name}: must be {' or '.join(allowed)}")
        routes[name] = action
    return routes


class SettingsError(Exception):
    """A setting has a value the app cannot run with. The message names the setting, never its value
    (it may be a key)."""


class Settings(BaseModel):
    """Every setting, by its app setting's name (the alias). What each does and its default:
    README.md's settings tables, which tests/test_docs.py keeps in step with this class (the names
    and defaults; the bounds are each Field's, here)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    # The upstream: OpenAI or any OpenAI-compatible server...
    openai_api_key: SecretStr | None = Field(None, alias="OPENAI_API_KEY")
    openai_base_url: str | None = Field(None, alias="OPENAI_BASE_URL")
    openai_model: str = Field("gpt-4o-mini", alias="OPENAI_MODEL", min_length=1)
    # ...or Azure OpenAI (with no key: Entra ID, azure-identity's DefaultAzureCredential)...
    azure_openai_endpoint: str | None = Field(None, alias="AZURE_OPENAI_ENDPOINT")
    azure_openai_deployment: str | None = Field(None, alias="AZURE_OPENAI_DEPLOYMENT", min_length=1)
    azure_openai_api_version: str | None = Field(None, alias="AZURE_OPENAI_API_VERSION", min_length=1)
    azure_openai_api_key: SecretStr | None = Field(None, alias="AZURE_OPENAI_API_KEY")
    # ...or a pool of several (docs/pool.md; parsed into entries by upstreams/config.py).
    upstreams: str | None = Field(None, alias="UPSTREAMS")
    entry_first_token_timeout: float | None = Field(None, alias="UPSTREAM_FIRST_TOKEN_TIMEOUT_SECONDS", gt=0, le=3600)
    upstream_open_seconds: float = Field(5.0, alias="UPSTREAM_OPEN_SECONDS", gt=0, le=3600)
    upstream_probe_seconds: float = Field(10.0, alias="UPSTREAM_PROBE_SECONDS", gt=0, le=3600)
    upstream_retry_after_wait: float = Field(0.0, alias="UPSTREAM_RETRY_AFTER_WAIT_SECONDS", ge=0, le=60)
    upstream_retry_server_error: bool = Field(False, alias="UPSTREAM_RETRY_SERVER_ERROR")
    # Comma-separated CLASS=ACTION over ERROR_ROUTES' defaults.
    upstream_error_routes: str = Field("", alias="UPSTREAM_ERROR_ROUTES")
    # Models a request may name (comma-separated); empty: any.
    allowed_models: tuple[str, ...] = Field((), alias="ALLOWED_MODELS")

    # Built-in pipeline steps (see chatstream/pipeline.py).
    system_prompt: str | None = Field(None, alias="SYSTEM_PROMPT")
    max_prompt_chars: int | None = Field(None, alias="MAX_PROMPT_CHARS", gt=0)
    blocked_terms: tuple[str, ...] = Field((), alias="BLOCKED_TERMS")

    # Time limits, in seconds.
    upstream_connect_timeout: float = Field(10.0, alias="UPSTREAM_CONNECT_TIMEOUT_SECONDS", gt=0, le=120)
    first_token_timeout: float = Field(120.0, alias="FIRST_TOKEN_TIMEOUT_SECONDS", gt=0, le=3600)
    idle_timeout: float = Field(60.0, alias="IDLE_TIMEOUT_SECONDS", gt=0, le=3600)
    total_timeout: float = Field(600.0, alias="TOTAL_TIMEOUT_SECONDS", gt=0, le=86400)
    heartbeat: float = Field(15.0, alias="HEARTBEAT_SECONDS", gt=0, le=200)
    usage_wait: float = Field(2.0, alias="USAGE_WAIT_SECONDS", ge=0, le=60)
    upstream_max_retries: int = Field(2, alias="UPSTREAM_MAX_RETRIES", ge=0, le=10)
    # Continued answers (continuation.py).
    continue_on_upstream_failure: bool = Field(True, alias="CONTINUE_ON_UPSTREAM_FAILURE")
    continue_max: int = Field(2, alias="CONTINUE_MAX", ge=0, le=10)

    # Request limits.
    max_body_bytes: int = Field(1_048_576, alias="MAX_BODY_BYTES", gt=0, le=100 * 1_048_576)

    # Resumable streams (docs/resumable.md), in the app's storage (AzureWebJobsStorage).
    resumable_streams: bool = Field(False, alias="RESUMABLE_STREAMS")
    resume_abandon_seconds: float = Field(30.0, alias="RESUME_ABANDON_SECONDS", gt=0, le=3600)
    resume_ttl_seconds: float = Field(600.0, alias="RESUME_TTL_SECONDS", gt=0, le=7 * 86400)

    # The drain on SIGTERM (lifecycle.py). At most 230: Azure ends an HTTP response at 230 s anyway.
    drain_seconds: float = Field(20.0, alias="DRAIN_SECONDS", ge=0, le=230)

    # The browser pages (pages.py). Unset: on when running locally, off in Azure.
    playground_enabled: bool | None = Field(None, alias="PLAYGROUND_ENABLED")
    console_enabled: bool | None = Field(None, alias="CONSOLE_ENABLED")

    # Callers (docs/callers.md): ``required``, every model route needs a caller key.
    caller_keys: Literal["off", "required"] = Field("off", alias="CALLER_KEYS")
    caller_cache_seconds: float = Field(10.0, alias="CALLER_CACHE_SECONDS", gt=0, le=30)
    default_max_output_tokens: int = Field(4096, alias="DEFAULT_MAX_OUTPUT_TOKENS", ge=1, le=1_000_000)
    referenced_context_tokens: int = Field(16_384, alias="REFERENCED_CONTEXT_TOKENS", ge=0, le=10_000_000)
    ledger_retention_days: int = Field(0, alias="LEDGER_RETENTION_DAYS", ge=0, le=36_500)

    @field_validator("allowed_models", "blocked_terms", mode="before")
    @classmethod
    def _comma_list(cls, value):
        if isinstance(value, str):
            return tuple(t.strip() for t in value.split(",") if t.strip())
        return value

    @field_validator("resumable_streams", mode="before")
    @classmethod
    def _switch(cls, value):
        if isinstance(value, str):
            word = value.strip().lower()
            if word in SWITCH_ON or word in SWITCH_OFF:
                return word in SWITCH_ON
            raise ValueError(f"must be on or off (also {'/'.join(SWITCH_ON[1:])} or {'/'.join(SWITCH_OFF[1:])})")
        return value

    @field_validator("upstream_error_routes")
    @classmethod
    def _error_routes(cls, value: str) -> str:
        parse_error_routes(value)
        return value

    @property
    def error_routes(self) -> dict[str, str]:
        """UPSTREAM_ERROR_ROUTES over the defaults: error class → ``larger``, ``next`` or ``stop``."""
        return {**ERROR_ROUTES, **parse_error_routes(self.upstream_error_routes)}

    @field_validator("caller_keys", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("openai_base_url", "azure_openai_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("openai_api_key", "azure_openai_api_key", "system_prompt", "upstreams", mode="before")
    @classmethod
    def _blank_is_unset(cls, value):
        return None if value in (None, "") else value

    @model_validator(mode="after")
    def _azure_needs_a_deployment(self):
        if self.azure_openai_endpoint and not self.azure_openai_deployment:
            raise ValueError("AZURE_OPENAI_ENDPOINT is set, so AZURE_OPENAI_DEPLOYMENT is required")
        return self

    @property
    def pooled(self) -> bool:
        """``UPSTREAMS`` is set: the pool's entries replace the single-upstream settings."""
        return self.upstreams is not None and bool(self.upstreams.strip())

    @property
    def upstream_kind(self) -> str:
        """``azure`` (Azure OpenAI), ``openai`` (OpenAI or a compatible server) or ``none``."""
        if self.azure_openai_endpoint:
            return "azure"
        if self.openai_api_key is not None or self.openai_base_url is not None:
            return "openai"
        return "none"

    @property
    def upstream_configured(self) -> bool:
        return self.pooled or self.upstream_kind != "none"

    @property
    def default_model(self) -> str:
        if self.upstream_kind == "azure" and self.azure_openai_deployment:  # required with the endpoint
            return self.azure_openai_deployment
        return self.openai_model

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings from ``environ`` (an empty value is unset), or SettingsError."""
        names = {f.alias for f in cls.model_fields.values() if f.alias}
        values = {k: v for k, v in environ.items() if k in names and v != ""}
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            # pydantic's own text would echo the input; a key must never reach a log.
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"invalid app settings: {problems}") from None
        return settings
