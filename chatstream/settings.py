"""App settings: environment variables (Azure app settings, or local.settings.json locally),
read and validated once at start-up into one typed object."""
from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator


class SettingsError(Exception):
    """A setting has a value the app cannot run with. The message names the setting, never its value
    (it may be a key)."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    # Upstream (any OpenAI-compatible server).
    openai_api_key: SecretStr | None = Field(None, alias="OPENAI_API_KEY")
    openai_base_url: str | None = Field(None, alias="OPENAI_BASE_URL")
    openai_model: str = Field("gpt-4o-mini", alias="OPENAI_MODEL", min_length=1)

    # Time limits, in seconds.
    upstream_connect_timeout: float = Field(10.0, alias="UPSTREAM_CONNECT_TIMEOUT_SECONDS", gt=0, le=120)
    first_token_timeout: float = Field(120.0, alias="FIRST_TOKEN_TIMEOUT_SECONDS", gt=0, le=3600)
    idle_timeout: float = Field(60.0, alias="IDLE_TIMEOUT_SECONDS", gt=0, le=3600)
    total_timeout: float = Field(600.0, alias="TOTAL_TIMEOUT_SECONDS", gt=0, le=86400)
    heartbeat: float = Field(15.0, alias="HEARTBEAT_SECONDS", gt=0, le=200)
    usage_wait: float = Field(2.0, alias="USAGE_WAIT_SECONDS", ge=0, le=60)
    upstream_max_retries: int = Field(2, alias="UPSTREAM_MAX_RETRIES", ge=0, le=10)

    # Request limits.
    max_body_bytes: int = Field(1_048_576, alias="MAX_BODY_BYTES", gt=0, le=100 * 1_048_576)

    @field_validator("openai_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("openai_api_key", mode="before")
    @classmethod
    def _blank_is_unset(cls, value):
        return None if value in (None, "") else value

    @property
    def upstream_configured(self) -> bool:
        return self.openai_api_key is not None or self.openai_base_url is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        names = {f.alias for f in cls.model_fields.values() if f.alias}
        values = {k: v for k, v in environ.items() if k in names and (v != "" or k == "OPENAI_API_KEY")}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            # pydantic's own text would echo the input; a key must never reach a log.
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"invalid app settings: {problems}") from None
