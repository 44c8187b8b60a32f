"""Callers: who may call the model routes, with their own keys and limits (docs/callers.md).

A caller has a name (admin-chosen), optional limits (tokens and requests per minute, a token budget
per day, month or in total), optionally the models it may use and an expiry. Its key is shown once,
when it is created or rotated; the store keeps only the key's SHA-256.

Table ``chatstreamCallers``, one partition (``callers``), so that every change is one atomic
entity-group transaction:

- ``c|<name>``: the caller (limits, models, expiry, created, key hash and hint);
- ``k|<sha256 of the key>``: the key index, holding a copy of the caller, so that authenticating a
  key is one point read. Create, update, rotate and delete change both rows in one transaction,
  the caller row under its ETag (two admins patching at once do not lose an update).

``CallerRegistry.authenticate`` caches each answer (a caller, or "no such key") per instance for
``cache_seconds``: a revoked or rotated key stops working on every instance within that time, and a
key check costs a store read only once per key, instance and period."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from azure.core import MatchConditions
from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import EdmType, EntityProperty, TableTransactionError, UpdateMode
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from ..errors import ApiError, invalid_request
from ..record import log_safe
from .calls import StoreDown, bounded, store_unavailable
from .store import CALLERS_TABLE, LIMITS_TABLE, Store

log = logging.getLogger("chatstream")

KEY_PREFIX = "csk-"
KEY_BYTES = 32  # 256 random bits: base64url, 43 characters after the prefix
_KEY_SHAPE = re.compile(r"csk-[A-Za-z0-9_-]{43}")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# The bounds of a caller's settings (docs/callers.md, "Limits").
MAX_TOKENS_PER_MINUTE = 1_000_000_000
MAX_REQUESTS_PER_MINUTE = 1_000_000
MAX_TOKEN_BUDGET = 1_000_000_000_000
MAX_MODELS = 100
MAX_MODEL_NAME = 256
MAX_CACHED_KEYS = 10_000  # key answers (callers and "no such key") kept per instance, least recent dropped

PARTITION = "callers"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

PositiveTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_PER_MINUTE)]
PositiveRequests = Annotated[StrictInt, Field(ge=1, le=MAX_REQUESTS_PER_MINUTE)]
PositiveBudget = Annotated[StrictInt, Field(ge=1, le=MAX_TOKEN_BUDGET)]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME)]
Period = Literal["day", "month", "total"]


def hash_key(key: str) -> str:
    """The stored form of a key. A fast hash is right here: the key is 256 random bits, so nobody
    can guess it from its hash however many hashes per second they try; slow, salted password
    hashes (bcrypt, argon2) exist for low-entropy passwords, would cost milliseconds per check, and
    their salt would rule out the point-read index."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The caller key a request carries, as OpenAI clients send it (``Authorization: Bearer KEY``)
    or as Azure OpenAI's clients do (``api-key: KEY``); None when it carries neither."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("api-key")
    return key.strip() if key and key.strip() else None


@dataclass(frozen=True, kw_only=True)
class Caller:
    """A caller as the request path sees it (never its key)."""
    name: str
    id: str  # made at creation: a caller deleted and created again under its name starts afresh
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    token_budget: int | None = None
    budget_period: Period = "total"
    models: tuple[str, ...] | None = None
    expires_at: datetime | None = None
    created_at: datetime
    key_hint: str = ""  # the key's last 4 characters, to tell keys apart

    @property
    def limits_partition(self) -> str:
        """Its counters' partition in ``chatstreamLimits`` (chatstream/state/quota.py)."""
        return f"{self.name}|{self.id}"

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at.timestamp() <= now

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def require_model(self, model: str) -> None:
        """A 404 ``model_not_found`` (OpenAI's answer for a model one may not use) unless allowed."""
        if not self.allows(model):
            raise ApiError(404, "model_not_found",
                           f"The model {model!r} does not exist or this caller does not have access to it.", "model")

    def public(self) -> dict[str, Any]:
        """The caller as the admin API shows it: everything but the key (its last 4 characters only)."""
        return {"object": "caller", "name": self.name, "id": self.id,
                "tokens_per_minute": self.tokens_per_minute, "requests_per_minute": self.requests_per_minute,
                "token_budget": self.token_budget, "budget_period": self.budget_period,
                "models": list(self.models) if self.models is not None else None,
                "expires_at": _iso(self.expires_at), "created_at": _iso(self.created_at),
                "key_hint": self.key_hint}


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: PositiveTokens | None = None
    requests_per_minute: PositiveRequests | None = None
    token_budget: PositiveBudget | None = None
    budget_period: Period = "total"
    models: Annotated[list[ModelName], Field(min_length=1, max_length=MAX_MODELS)] | None = None
    expires_at: AwareDatetime | None = None

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: list[str] | None) -> list[str] | None:
        if models is None:
            return None
        for i, model in enumerate(models):
            if _CONTROL.search(model) or model != model.strip():
                raise ValueError(f"models[{i}] has control characters or surrounding spaces")
        if len(set(models)) != len(models):
            raise ValueError("names a model twice")
        return models

    @field_validator("expires_at")
    @classmethod
    def _in_range(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.year > 9000:
            raise ValueError("must be before the year 9000")
        return value


class CallerSpec(_Limits):
    """``POST /api/manage/callers``."""
    name: str

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: object) -> object:
        if isinstance(value, str) and not NAME_PATTERN.fullmatch(value):
            raise ValueError("must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value


class CallerPatch(_Limits):
    """``PATCH /api/manage/callers/{name}``: the fields given change (``null`` removes a limit, the
    model list or the expiry); the name cannot change."""
    budget_period: Period | None = None  # type: ignore[assignment]


def _describe(exc: ValidationError) -> ApiError:
    """pydantic's first error as a 400 naming the field (never echoing the value)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if param is not None and len(param) > 64:
        param = param[:64] + "…"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif len(loc) > 1:
        message = f"[{']['.join(loc[1:])}]: {message}"
    return invalid_request(f"{param}: {message}" if param else message, param)


def _validate(model: type[BaseModel], data: object) -> Any:
    if not isinstance(data, Mapping):
        raise invalid_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _describe(exc) from None


def _not_found(name: str) -> ApiError:
    return ApiError(404, "caller_not_found", f"no caller named {log_safe(name)[:80]!r}", "name")


def invalid_key(expired: bool = False) -> ApiError:
    """401 for a key that is unknown, revoked, rotated or expired; the message never carries the key."""
    message = ("This caller key has expired." if expired else
               "Incorrect API key provided: the caller key is unknown, revoked or rotated.")
    return ApiError(401, "invalid_api_key", message)


def _int64(value: int | None) -> EntityProperty | None:
    return EntityProperty(value, EdmType.INT64) if value is not None else None


def _read_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.value) if isinstance(value, EntityProperty) else int(value)


def _entity(row_key: str, caller: Caller, key_hash: str) -> dict[str, Any]:
    entity: dict[str, Any] = {
        "PartitionKey": PARTITION, "RowKey": row_key, "name": caller.name, "id": caller.id,
        "tokens_per_minute": _int64(caller.tokens_per_minute),
        "requests_per_minute": _int64(caller.requests_per_minute),
        "token_budget": _int64(caller.token_budget), "budget_period": caller.budget_period,
        "models": json.dumps(list(caller.models)) if caller.models is not None else None,
        "expires_at": _iso(caller.expires_at), "created_at": _iso(caller.created_at),
        "key_hash": key_hash, "key_hint": caller.key_hint,
    }
    return {k: v for k, v in entity.items() if v is not None}


def _caller(entity: Mapping[str, Any]) -> Caller:
    models = entity.get("models")
    expires = entity.get("expires_at")
    return Caller(name=entity["name"], id=entity["id"],
                  tokens_per_minute=_read_int(entity.get("tokens_per_minute")),
                  requests_per_minute=_read_int(entity.get("requests_per_minute")),
                  token_budget=_read_int(entity.get("token_budget")),
                  budget_period=entity.get("budget_period") or "total",
                  models=tuple(json.loads(models)) if models else None,
                  expires_at=datetime.fromisoformat(expires) if expires else None,
                  created_at=datetime.fromisoformat(entity["created_at"]), key_hint=entity.get("key_hint", ""))


def _caller_row(name: str) -> str:
    return f"c|{name}"


def _key_row(key_hash: str) -> str:
    return f"k|{key_hash}"


_IF_MATCH = "match_condition"


class CallerRegistry:
    """The callers and their keys, in the store; key checks cached per instance."""

    def __init__(self, store: Store, cache_seconds: float = 10.0, clock: Callable[[], float] = time.time,
                 cache_size: int = MAX_CACHED_KEYS):
        self.store = store
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[float, Caller | None]] = OrderedDict()
        self._lookups: dict[str, asyncio.Future] = {}
        self.store_reads = 0  # key lookups that reached the store (tests and docs/callers.md use it)

    # --- the request path -------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> Caller:
        """The caller whose key this is, or 401 ``invalid_api_key`` (unknown, revoked, rotated,
        expired); 503 ``caller_store_unavailable`` when the store must be asked and does not answer.
        A key's answer, yes or no, is kept ``cache_seconds`` per instance."""
        if not isinstance(key, str) or not _KEY_SHAPE.fullmatch(key):
            raise invalid_key()  # not one of ours: no store read, nothing cached
        key_hash = hash_key(key)
        now = self.clock()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key_hash)
            caller = cached[1]
        else:
            caller = await self._lookup(key_hash)
        if caller is None:
            raise invalid_key()
        if caller.expired(self.clock()):
            raise invalid_key(expired=True)
        return caller

    async def _lookup(self, key_hash: str) -> Caller | None:
        """One store read per key at a time: concurrent first requests with one key share it."""
        pending = self._lookups.get(key_hash)
        if pending is None:
            pending = self._lookups[key_hash] = asyncio.ensure_future(self._read_key(key_hash))
            pending.add_done_callback(lambda _: self._lookups.pop(key_hash, None))
        return await asyncio.shield(pending)

    async def _read_key(self, key_hash: str) -> Caller | None:
        async def read() -> Caller | None:
            table = await self.store.table(CALLERS_TABLE)
            try:
                return _caller(await table.get_entity(PARTITION, _key_row(key_hash)))
            except ResourceNotFoundError:
                return None

        self.store_reads += 1
        asked = self.clock()  # the answer is kept from when it was asked for: a key revoked after that
        try:                  # stops working at most cache_seconds after its revocation, exactly
            caller = await bounded(read())
        except StoreDown as exc:
            log.warning("caller store: key check failed: %s", exc)
            raise store_unavailable() from None
        self._remember(key_hash, caller, asked)
        return caller

    def _remember(self, key_hash: str, caller: Caller | None, asked: float) -> None:
        self._cache[key_hash] = (asked + self.cache_seconds, caller)
        self._cache.move_to_end(key_hash)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def forget(self, key_hash: str) -> None:
        self._cache.pop(key_hash, None)

    # --- the admin API ------------------------------------------------------------------------

    async def _admin(self, operation):
        try:
            return await bounded(operation)
        except StoreDown as exc:
            log.warning("caller store: admin operation failed: %s", exc)
            raise store_unavailable() from None

    async def create(self, spec: Mapping[str, Any]) -> tuple[Caller, str]:
        """A new caller and its key (shown this once). 400 naming the field for bad input, 400
        ``name`` when the name is taken."""
        data: CallerSpec = _validate(CallerSpec, spec)
        if data.expires_at is not None and data.expires_at.timestamp() <= self.clock():
            raise invalid_request("expires_at: must be in the future", "expires_at")
        key = new_key()
        caller = Caller(name=data.name, id=secrets.token_hex(6), tokens_per_minute=data.tokens_per_minute,
                        requests_per_minute=data.requests_per_minute, token_budget=data.token_budget,
                        budget_period=data.budget_period,
                        models=tuple(data.models) if data.models is not None else None,
                        expires_at=data.expires_at, created_at=datetime.fromtimestamp(self.clock(), UTC),
                        key_hint=key[-4:])
        key_hash = hash_key(key)

        async def write() -> None:
            table = await self.store.table(CALLERS_TABLE)
            await table.submit_transaction([("create", _entity(_caller_row(caller.name), caller, key_hash)),
                                            ("create", _entity(_key_row(key_hash), caller, key_hash))])

        try:
            await self._admin(write())
        except TableTransactionError as exc:
            if exc.status_code == 409:
                raise invalid_request(f"name: a caller named {caller.name!r} already exists", "name") from None
            raise
        log.info("caller %s created (key …%s)", caller.name, caller.key_hint)
        return caller, key

    async def list(self) -> list[Caller]:
        async def read() -> list[Caller]:
            table = await self.store.table(CALLERS_TABLE)
            rows = table.query_entities("PartitionKey eq @p and RowKey ge @lo and RowKey lt @hi",
                                        parameters={"p": PARTITION, "lo": "c|", "hi": "c}"})
            return [_caller(row) async for row in rows]

        return sorted(await self._admin(read()), key=lambda c: c.name)

    async def _row(self, name: str) -> tuple[Caller, str, str]:
        """The caller row: the caller, its key hash and its ETag; 404 when there is none."""
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise _not_found(name if isinstance(name, str) else "")

        async def read():
            table = await self.store.table(CALLERS_TABLE)
            try:
                return await table.get_entity(PARTITION, _caller_row(name))
            except ResourceNotFoundError:
                return None

        row = await self._admin(read())
        if row is None:
            raise _not_found(name)
        return _caller(row), row["key_hash"], row.metadata["etag"]

    async def get(self, name: str) -> Caller:
        return (await self._row(name))[0]

    async def update(self, name: str, patch: Mapping[str, Any]) -> Caller:
        """Change the fields ``patch`` names; the key stays. Other instances see the change within
        ``cache_seconds``."""
        data: CallerPatch = _validate(CallerPatch, patch)
        given = data.model_fields_set
        if "expires_at" in given and data.expires_at is not None and data.expires_at.timestamp() <= self.clock():
            raise invalid_request("expires_at: must be in the future", "expires_at")
        for _ in range(5):  # another admin's change in between: read again and reapply
            caller, key_hash, etag = await self._row(name)
            changes: dict[str, Any] = {f: getattr(data, f) for f in given}
            if "models" in changes and changes["models"] is not None:
                changes["models"] = tuple(changes["models"])
            if changes.get("budget_period", "total") is None:
                changes["budget_period"] = "total"
            updated = replace(caller, **changes)

            async def write(updated=updated, key_hash=key_hash, etag=etag) -> None:
                table = await self.store.table(CALLERS_TABLE)
                await table.submit_transaction([
                    ("update", _entity(_caller_row(name), updated, key_hash),
                     {"mode": UpdateMode.REPLACE, "etag": etag, _IF_MATCH: MatchConditions.IfNotModified}),
                    ("update", _entity(_key_row(key_hash), updated, key_hash), {"mode": UpdateMode.REPLACE}),
                ])

            try:
                await self._admin(write())
            except (TableTransactionError, ResourceModifiedError) as exc:
                if getattr(exc, "status_code", None) in (404, 412):
                    continue
                raise
            self.forget(key_hash)
            log.info("caller %s updated (%s)", name, ", ".join(sorted(given)) or "nothing")
            return updated
        raise ApiError(409, "conflict", "the caller changed repeatedly while being updated; try again", "name")

    async def delete(self, name: str) -> Caller:
        """Remove the caller and its key (which stops working on every instance within
        ``cache_seconds``), and, best effort, its limit counters."""
        for _ in range(5):
            caller, key_hash, etag = await self._row(name)

            async def write(key_hash=key_hash, etag=etag) -> None:
                table = await self.store.table(CALLERS_TABLE)
                await table.submit_transaction([
                    ("delete", {"PartitionKey": PARTITION, "RowKey": _caller_row(name)},
                     {"etag": etag, _IF_MATCH: MatchConditions.IfNotModified}),
                    ("delete", {"PartitionKey": PARTITION, "RowKey": _key_row(key_hash)}),
                ])

            try:
                await self._admin(write())
            except TableTransactionError as exc:
                if exc.status_code in (404, 412):
                    continue
                raise
            self.forget(key_hash)
            await self._drop_counters(caller)
            log.info("caller %s deleted", name)
            return caller
        raise ApiError(409, "conflict", "the caller changed repeatedly while being deleted; try again", "name")

    async def _drop_counters(self, caller: Caller) -> None:
        async def drop() -> None:
            table = await self.store.table(LIMITS_TABLE)
            rows = table.query_entities("PartitionKey eq @p", parameters={"p": caller.limits_partition},
                                        select=["PartitionKey", "RowKey"])
            async for row in rows:
                try:
                    await table.delete_entity(row["PartitionKey"], row["RowKey"])
                except ResourceNotFoundError:
                    pass

        try:
            await bounded(drop())
        except StoreDown as exc:  # harmless: a caller created again under this name gets a new id
            log.warning("caller %s deleted; its limit counters were left in the store: %s", caller.name, exc)

    async def rotate(self, name: str) -> tuple[Caller, str]:
        """A new key for the caller; the old one stops working (on every instance within
        ``cache_seconds``). Limits, usage and counters stay."""
        for _ in range(5):
            caller, old_hash, etag = await self._row(name)
            key = new_key()
            new_hash = hash_key(key)
            rotated = replace(caller, key_hint=key[-4:])

            async def write(rotated=rotated, old_hash=old_hash, new_hash=new_hash, etag=etag) -> None:
                table = await self.store.table(CALLERS_TABLE)
                await table.submit_transaction([
                    ("update", _entity(_caller_row(name), rotated, new_hash),
                     {"mode": UpdateMode.REPLACE, "etag": etag, _IF_MATCH: MatchConditions.IfNotModified}),
                    ("delete", {"PartitionKey": PARTITION, "RowKey": _key_row(old_hash)}),
                    ("create", _entity(_key_row(new_hash), rotated, new_hash)),
                ])

            try:
                await self._admin(write())
            except TableTransactionError as exc:
                if exc.status_code in (404, 409, 412):
                    continue
                raise
            self.forget(old_hash)
            log.info("caller %s: key rotated (now …%s)", name, rotated.key_hint)
            return rotated, key
        raise ApiError(409, "conflict", "the caller changed repeatedly while its key was rotated; try again", "name")


__all__ = [
    "KEY_PREFIX",
    "Caller",
    "CallerPatch",
    "CallerRegistry",
    "CallerSpec",
    "hash_key",
    "invalid_key",
    "key_from_headers",
    "new_key",
]
