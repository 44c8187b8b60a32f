"""What `func start` reads from the app folder (local.settings.json Values, host.json's route prefix),
and the host's own settings (the front server's limits)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .cors import CorsPolicy


class ConfigError(Exception):
    """A settings file exists but cannot be used."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name} must hold a JSON object")
    return data


def local_settings_values(app_dir: Path) -> dict[str, str]:
    """The ``Values`` of local.settings.json (empty when the file is absent)."""
    path = app_dir / "local.settings.json"
    if not path.exists():
        return {}
    values = _read_json(path).get("Values", {})
    if not isinstance(values, dict):
        raise ConfigError("local.settings.json: Values must be an object")
    return {str(k): "" if v is None else str(v) for k, v in values.items()}


def apply_local_settings(app_dir: Path, environ=os.environ) -> list[str]:
    """Copy Values into the environment; variables already set win. Returns the names applied."""
    applied = []
    for name, value in local_settings_values(app_dir).items():
        if name not in environ:
            environ[name] = value
            applied.append(name)
    return applied


def route_prefix(app_dir: Path) -> str:
    """host.json extensions.http.routePrefix, default ``api`` (an empty string is allowed)."""
    path = app_dir / "host.json"
    if not path.exists():
        return "api"
    http = _read_json(path).get("extensions", {}).get("http", {})
    prefix = http.get("routePrefix", "api") if isinstance(http, dict) else "api"
    return str(prefix).strip("/")


@dataclass(frozen=True)
class FrontSettings:
    """The host's caller-facing HTTP/1.1 server: its limits (see front.py)."""

    max_header_bytes: int = 64 * 1024  # request line + headers; more is refused with 431
    header_timeout: float = 10.0  # a request's head must be complete this long after its first byte (408)
    body_timeout: float = 15.0  # its body this long after the head (408)
    keepalive_timeout: float = 15.0  # an idle connection between requests is closed after this
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # browser origins allowed besides the host's own


# environment variable → (field, type); the CLI flags of __main__ override these.
FRONT_ENV = {
    "DEVHOST_MAX_HEADER_BYTES": ("max_header_bytes", int),
    "DEVHOST_HEADER_TIMEOUT_SECONDS": ("header_timeout", float),
    "DEVHOST_BODY_TIMEOUT_SECONDS": ("body_timeout", float),
    "DEVHOST_KEEPALIVE_TIMEOUT_SECONDS": ("keepalive_timeout", float),
}


def front_settings(environ=os.environ, **flags) -> FrontSettings:
    """FrontSettings from the environment, then from ``flags`` (None: not given). A value that is
    not a positive number raises ConfigError naming the setting."""
    values = {}
    for name, (fieldname, kind) in FRONT_ENV.items():
        raw = environ.get(name)
        if raw not in (None, ""):
            values[fieldname] = _positive(name, raw, kind)
    for fieldname, value in flags.items():
        if value is not None:
            values[fieldname] = _positive("--" + fieldname.replace("_", "-"), value, type(value))
    return FrontSettings(**values)


def _positive(name: str, raw, kind):
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{name} must be a positive {'whole ' if kind is int else ''}number")
    return value


def with_cors(front: FrontSettings, app_dir: Path, flag: str | None, environ=os.environ) -> FrontSettings:
    """``front`` with the CORS origins of the first of: the --cors flag, CORS_ALLOWED_ORIGINS (also
    from local.settings.json Values), local.settings.json Host.CORS (what `func start` reads)."""
    if flag is not None:
        text, name = flag, "--cors"
    elif environ.get("CORS_ALLOWED_ORIGINS"):
        text, name = environ["CORS_ALLOWED_ORIGINS"], "CORS_ALLOWED_ORIGINS"
    else:
        path = app_dir / "local.settings.json"
        host = _read_json(path).get("Host", {}) if path.exists() else {}
        text = host.get("CORS", "") if isinstance(host, dict) else ""
        text, name = ("" if text is None else str(text)), "local.settings.json Host.CORS"
    try:
        return replace(front, cors=CorsPolicy.parse(text, name))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


WORKER_PROCESS_COUNT = "FUNCTIONS_WORKER_PROCESS_COUNT"


def worker_process_count(environ=os.environ) -> int:
    """``FUNCTIONS_WORKER_PROCESS_COUNT``: how many worker processes the host runs (1-10, default 1),
    as the Functions host reads it."""
    raw = environ.get(WORKER_PROCESS_COUNT, "").strip()
    if not raw:
        return 1
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if not 1 <= count <= 10:
        raise ConfigError(f"{WORKER_PROCESS_COUNT} must be a whole number from 1 to 10 (got {raw!r})")
    return count


SHUTDOWN_TIMEOUT = "ASPNETCORE_SHUTDOWNTIMEOUTSECONDS"
DEFAULT_SHUTDOWN_TIMEOUT = 5  # ASP.NET Core's WebHostOptions.ShutdownTimeout, which the Functions host keeps


def shutdown_timeout(environ=os.environ) -> int:
    """``ASPNETCORE_SHUTDOWNTIMEOUTSECONDS``: the seconds the requests in flight get after SIGTERM
    before their connections are cut (default 5), read as the Functions host reads it (ASP.NET Core's
    web host: a whole number of seconds). A value the host would ignore is an error here."""
    raw = environ.get(SHUTDOWN_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_SHUTDOWN_TIMEOUT
    if not raw.isdigit() or not raw.isascii() or int(raw) > 3600:
        raise ConfigError(f"{SHUTDOWN_TIMEOUT} must be a whole number of seconds from 0 to 3600 (got {raw!r})")
    return int(raw)
