"""``UPSTREAMS``: the schema of one upstream entry, and the setting parsed into entries (once, at
start-up). The single-upstream settings (``OPENAI_*`` / ``AZURE_OPENAI_*``) describe one entry the
same way, so the rest of the app sees one kind of upstream either way."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, ValidationError, model_validator

from ..http import too_deep
from ..settings import Settings, SettingsError

SETTING = "UPSTREAMS"
SINGLE_NAME = "default"
# Bounds on the setting: each entry gets an SDK client with its own connection pool, so a long list
# costs start-up time and memory (1,000 entries took 23 s and 912 MB); no real pool needs more.
MAX_ENTRIES = 64
MAX_CHARS = 256 * 1024
MAX_DEPTH = 8  # a list of entry objects holding lists and maps: three levels are all a valid value uses


@dataclass(frozen=True, eq=False, repr=False)
class Entry:
    """One upstream of the pool. ``api_key`` is the resolved key (masked in every repr); ``auth``
    says how to authenticate: ``key``, ``entra`` (Azure without a key) or ``none``."""

    name: str
    kind: Literal["openai", "azure"]
    url: str  # base_url (openai) or azure_endpoint (azure), without a trailing slash
    # Azure only: a dated API version (/openai/deployments/{deployment}/...?api-version=...); None, the
    # GA v1 API (/openai/v1/..., OpenAI's paths with the deployment as the model, no api-version).
    api_version: str | None = None
    api_key: SecretStr | None = field(default=None, repr=False)
    key_setting: str | None = None  # the app setting the key came from (safe to log)
    priority: int = 1
    weight: float = 1.0
    models: tuple[str, ...] | None = None  # None: serves any model
    # A requested model name -> the name this entry is sent instead (an Azure deployment, or another
    # server's own model: "gpt-4o-mini" served as "llama-3.1-8b"); unmapped names go as they are.
    deployments: Mapping[str, str] = field(default_factory=dict)
    # How an answer cut short is continued on this entry (chatstream/continuation.py): ``prompt``, the
    # text so far as an assistant message and an instruction to go on; ``prefix``, a true prefix
    # continuation (``continue_final_message``: vLLM and other OpenAI-compatible servers).
    continuation: Literal["prompt", "prefix"] = "prompt"
    # The context window (tokens) of the model behind this entry, as the operator declares it: a
    # request too long for one entry goes to those declaring a larger one (UPSTREAM_ERROR_ROUTES).
    context_window: int | None = None

    @property
    def auth(self) -> Literal["key", "entra", "none"]:
        if self.api_key is not None:
            return "key"
        return "entra" if self.kind == "azure" else "none"

    @property
    def dated(self) -> bool:
        """An Azure entry on a dated API version (not the v1 API)."""
        return self.kind == "azure" and self.api_version is not None

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __repr__(self) -> str:  # never the key, nor credentials a legacy URL might carry
        return (
            f"Entry({self.name!r}, {self.kind}, {display_url(self.url)!r}, auth={self.auth}, "
            f"priority={self.priority}, weight={self.weight}, models={self.models!r})"
        )

    def deployment(self, model: str) -> str:
        """The name sent upstream for ``model``: what ``deployments`` maps it to (an Azure deployment,
        or the entry's own model), else the model name itself."""
        return self.deployments.get(model, model)


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_SETTING_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_KEY_VAULT_REFERENCE = "@Microsoft.KeyVault("

Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_NAME)]
NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _EntrySpec(BaseModel):
    """One element of UPSTREAMS as written by the user."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Name
    base_url: str | None = None
    azure_endpoint: str | None = None
    api_version: NonEmpty | None = None
    api_key_setting: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=_SETTING_NAME)] | None = (
        None
    )
    priority: int = Field(1, ge=0, le=1000)
    weight: float = Field(1.0, gt=0, le=1_000_000, allow_inf_nan=False)
    models: list[NonEmpty] | None = Field(None, min_length=1)
    deployments: dict[NonEmpty, NonEmpty] | None = None
    continue_: Literal["prompt", "prefix"] = Field("prompt", alias="continue")
    context_window: int | None = Field(None, ge=1, le=1_000_000_000)

    @model_validator(mode="after")
    def _consistent(self) -> _EntrySpec:
        if (self.base_url is None) == (self.azure_endpoint is None):
            raise ValueError(
                "needs exactly one of base_url (OpenAI or a compatible server) and azure_endpoint (Azure OpenAI)"
            )
        for key in ("base_url", "azure_endpoint"):
            value = getattr(self, key)
            if value is not None and url_problem(value):
                raise ValueError(f"{key}: {url_problem(value)}")
        if self.azure_endpoint is not None and self.continue_ == "prefix":
            raise ValueError("continue: prefix needs a server that accepts continue_final_message (a base_url entry)")
        if self.base_url is not None and self.api_version is not None:
            raise ValueError("api_version: only for an azure_endpoint entry")
        if self.models is not None and len(set(self.models)) != len(self.models):
            raise ValueError("models: a model is listed twice")
        if self.deployments and self.models is not None:
            unserved = sorted(set(self.deployments) - set(self.models))
            if unserved:
                raise ValueError(f"deployments: maps {', '.join(map(repr, unserved))}, which models does not list")
        return self


def url_problem(url: str) -> str | None:
    """What is wrong with an upstream URL, without quoting it (it could carry credentials)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a bad port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (use api_key_setting)"
    if parts.query or parts.fragment:
        return "must not have a query or a fragment"
    if any(c.isspace() for c in url):
        return "must not contain spaces"
    del port
    return None


_PATTERN_HINTS = {
    "name": "use letters, digits, '.', '_' and '-', starting with a letter or digit",
    "api_key_setting": "must be the name of an app setting (letters, digits and '_')",
}


def _where(index: int, item: object) -> str:
    name = item.get("name") if isinstance(item, dict) else None
    if isinstance(name, str) and name and len(name) <= 64 and name.isprintable():
        return f"{SETTING}[{index}] ({json.dumps(name)})"
    return f"{SETTING}[{index}]"


def _problems(exc: ValidationError) -> list[str]:
    """pydantic's errors as ``field: message``, never with the input (it could be a key)."""
    out = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in error["loc"])
        msg = error["msg"].removeprefix("Value error, ")
        if error["type"] == "string_pattern_mismatch":
            msg = _PATTERN_HINTS.get(loc, msg)
        if error["type"] == "extra_forbidden":
            msg = "unknown key"
            if loc in ("api_key", "key", "apiKey"):
                msg += (
                    " (a key never goes in UPSTREAMS: put it in its own app setting and name that setting "
                    "in api_key_setting)"
                )
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {json.dumps(key)} appears twice in one object")
        seen[key] = value
    return seen


def _load(raw: str) -> list:
    if len(raw) > MAX_CHARS:
        raise SettingsError(f"{SETTING}: longer than {MAX_CHARS} characters")
    deep = SettingsError(f"{SETTING}: nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except RecursionError:
        raise deep from None
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{SETTING}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # from the hooks: the message is ours and quotes no value
        raise SettingsError(f"{SETTING}: not valid JSON ({exc})") from None
    if too_deep(data, MAX_DEPTH):
        raise deep
    if not isinstance(data, list):
        raise SettingsError(f"{SETTING}: must be a JSON list of upstream objects")
    if not data:
        raise SettingsError(f"{SETTING}: the list is empty (leave the setting out to use the single upstream settings)")
    if len(data) > MAX_ENTRIES:
        raise SettingsError(f"{SETTING}: {len(data)} entries; at most {MAX_ENTRIES}")
    return data


def _key(spec: _EntrySpec, where: str, environ: Mapping[str, str]) -> SecretStr | None:
    """The entry's key from the setting it names; SettingsError (never quoting the value) if unusable."""
    if spec.api_key_setting is None:
        return None
    value = environ.get(spec.api_key_setting, "")
    if not value.strip():
        raise SettingsError(f"{where}: api_key_setting: the app setting {spec.api_key_setting} is not set or empty")
    if value.startswith(_KEY_VAULT_REFERENCE):
        raise SettingsError(
            f"{where}: api_key_setting: the app setting {spec.api_key_setting} holds an unresolved "
            "Key Vault reference (check the app's identity can read the secret)"
        )
    return SecretStr(value)


def _entry(spec: _EntrySpec, key: SecretStr | None) -> Entry:
    azure = spec.azure_endpoint is not None
    return Entry(
        name=spec.name,
        kind="azure" if azure else "openai",
        url=(spec.azure_endpoint or spec.base_url or "").rstrip("/"),  # one of the two: _consistent
        api_version=spec.api_version if azure else None,
        api_key=key,
        key_setting=spec.api_key_setting,
        priority=spec.priority,
        weight=spec.weight,
        models=tuple(spec.models) if spec.models is not None else None,
        deployments=dict(spec.deployments or {}),
        continuation=spec.continue_,
        context_window=spec.context_window,
    )


def parse_upstreams(raw: str, environ: Mapping[str, str]) -> list[Entry]:
    """``UPSTREAMS`` → its entries, each key read from the setting its ``api_key_setting`` names.
    Raises SettingsError listing every problem found."""
    problems: list[str] = []
    entries: list[Entry] = []
    names: dict[str, int] = {}
    for index, item in enumerate(_load(raw)):
        where = _where(index, item)
        if not isinstance(item, dict):
            problems.append(f"{where}: must be a JSON object")
            continue
        try:
            spec = _EntrySpec.model_validate(item)
        except ValidationError as exc:
            problems.extend(f"{where}: {p}" for p in _problems(exc))
            continue
        folded = spec.name.casefold()
        if folded in names:
            problems.append(
                f"{where}: name: the same name as {SETTING}[{names[folded]}] (names must be unique, ignoring case)"
            )
            continue
        names[folded] = index
        try:
            entries.append(_entry(spec, _key(spec, where, environ)))
        except SettingsError as exc:
            problems.append(str(exc))
    if problems:
        raise SettingsError("invalid app settings: " + "; ".join(problems))
    return entries


def entries(settings: Settings, environ: Mapping[str, str]) -> tuple[Entry, ...]:
    """The upstream entries the settings describe: ``UPSTREAMS``' (``parse_upstreams``), else the one
    of the single-upstream settings; none when nothing is configured."""
    if settings.pooled:
        return tuple(parse_upstreams(settings.upstreams or "", environ))
    for name, url in (
        ("OPENAI_BASE_URL", settings.openai_base_url),
        ("AZURE_OPENAI_ENDPOINT", settings.azure_openai_endpoint),
    ):
        problem = url_problem(url) if url is not None else None
        if problem:
            raise SettingsError(f"invalid app settings: {name}: {problem}")
    # One entry that serves any model, so a request may name another model (or Azure deployment).
    if settings.azure_openai_endpoint:
        url = settings.azure_openai_endpoint.rstrip("/")
        return (Entry(SINGLE_NAME, "azure", url, settings.azure_openai_api_version, settings.azure_openai_api_key),)
    if settings.upstream_kind == "openai":  # no OPENAI_BASE_URL: the SDK's default, api.openai.com
        url = settings.openai_base_url or "https://api.openai.com/v1"
        return (Entry(SINGLE_NAME, "openai", url.rstrip("/"), api_key=settings.openai_api_key),)
    return ()


def display_url(url: str) -> str:
    """The URL without any user:password or query (``UPSTREAMS`` refuses them; OPENAI_BASE_URL is
    checked the same way at start-up, and this is the second line of defence)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=netloc, query="", fragment="").geturl()
