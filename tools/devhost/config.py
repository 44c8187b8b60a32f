"""What `func start` reads from the app folder: local.settings.json Values and host.json's route prefix."""
from __future__ import annotations

import json
import os
from pathlib import Path


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
