"""The registry of callers in the store (``CallerRegistry``): create, list, read, change, delete,
rotate; and ``authenticate``, which the request path calls with every caller key (cached per instance
for ``cache_seconds``: a revoked or rotated key stops working on every instance within that time, and
a key check costs a store read only once per key, instance and period)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import EdmType, EntityProperty, TableTransactionError, UpdateMode

from ..errors import ApiError, invalid_request
from ..record import log_safe
from .callers import (
    _KEY_SHAPE,
    MAX_CACHED_KEYS,
    NAME_PATTERN,
    PARTITION,
    Caller,
    CallerPatch,
    CallerSpec,
    _iso,
    _validate,
    hash_key,
    invalid_key,
    new_key,
)
from .calls import StoreDown, bounded, store_unavailable
from .legacy_store import CALLERS_TABLE, LIMITS_TABLE, Store

log = logging.getLogger("chatstream")


def _not_found(name: str) -> ApiError:
    return ApiError(404, "caller_not_found", f"no caller named {log_safe(name)[:80]!r}", "name")


def _int64(value: int | None) -> EntityProperty | None:
    return EntityProperty(value, EdmType.INT64) if value is not None else None


def _read_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.value) if isinstance(value, EntityProperty) else int(value)


def _entity(row_key: str, caller: Caller, key_hash: str) -> dict[str, Any]:
    entity: dict[str, Any] = {
        "PartitionKey": PARTITION,
        "RowKey": row_key,
        "name": caller.name,
        "id": caller.id,
        "tokens_per_minute": _int64(caller.tokens_per_minute),
        "requests_per_minute": _int64(caller.requests_per_minute),
        "token_budget": _int64(caller.token_budget),
        "budget_period": caller.budget_period,
        "models": json.dumps(list(caller.models)) if caller.models is not None else None,
        "expires_at": _iso(caller.expires_at),
        "created_at": _iso(caller.created_at),
        "key_hash": key_hash,
        "key_hint": caller.key_hint,
    }
    return {k: v for k, v in entity.items() if v is not None}


def _caller(entity: Mapping[str, Any]) -> Caller:
    models = entity.get("models")
    expires = entity.get("expires_at")
    return Caller(
        name=entity["name"],
        id=entity["id"],
        tokens_per_minute=_read_int(entity.get("tokens_per_minute")),
        requests_per_minute=_read_int(entity.get("requests_per_minute")),
        token_budget=_read_int(entity.get("token_budget")),
        budget_period=entity.get("budget_period") or "total",
        models=tuple(json.loads(models)) if models else None,
        expires_at=datetime.fromisoformat(expires) if expires else None,
        created_at=datetime.fromisoformat(entity["created_at"]),
        key_hint=entity.get("key_hint", ""),
    )


def _caller_row(name: str) -> str:
    return f"c|{name}"


def _key_row(key_hash: str) -> str:
    return f"k|{key_hash}"


_IF_MATCH = "match_condition"


class CallerRegistry:
    """The callers and their keys, in the store; key checks cached per instance."""

    def __init__(
        self,
        store: Store,
        cache_seconds: float = 10.0,
        clock: Callable[[], float] = time.time,
        cache_size: int = MAX_CACHED_KEYS,
    ):
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
        try:  # stops working at most cache_seconds after its revocation, exactly
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

    async def create(self, spec: object) -> tuple[Caller, str]:
        """A new caller and its key (shown this once). 400 naming the field for bad input, 400
        ``name`` when the name is taken."""
        data: CallerSpec = _validate(CallerSpec, spec)
        if data.expires_at is not None and data.expires_at.timestamp() <= self.clock():
            raise invalid_request("expires_at: must be in the future", "expires_at")
        key = new_key()
        caller = Caller(
            name=data.name,
            id=secrets.token_hex(6),
            tokens_per_minute=data.tokens_per_minute,
            requests_per_minute=data.requests_per_minute,
            token_budget=data.token_budget,
            budget_period=data.budget_period,
            models=tuple(data.models) if data.models is not None else None,
            expires_at=data.expires_at,
            created_at=datetime.fromtimestamp(self.clock(), UTC),
            key_hint=key[-4:],
        )
        key_hash = hash_key(key)

        async def write() -> None:
            table = await self.store.table(CALLERS_TABLE)
            await table.submit_transaction(
                [
                    ("create", _entity(_caller_row(caller.name), caller, key_hash)),
                    ("create", _entity(_key_row(key_hash), caller, key_hash)),
                ]
            )

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
            rows = table.query_entities(
                "PartitionKey eq @p and RowKey ge @lo and RowKey lt @hi",
                parameters={"p": PARTITION, "lo": "c|", "hi": "c}"},
            )
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

    async def update(self, name: str, patch: object) -> Caller:
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
                await table.submit_transaction(
                    [
                        (
                            "update",
                            _entity(_caller_row(name), updated, key_hash),
                            {"mode": UpdateMode.REPLACE, "etag": etag, _IF_MATCH: MatchConditions.IfNotModified},
                        ),
                        ("update", _entity(_key_row(key_hash), updated, key_hash), {"mode": UpdateMode.REPLACE}),
                    ]
                )

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
                await table.submit_transaction(
                    [
                        (
                            "delete",
                            {"PartitionKey": PARTITION, "RowKey": _caller_row(name)},
                            {"etag": etag, _IF_MATCH: MatchConditions.IfNotModified},
                        ),
                        ("delete", {"PartitionKey": PARTITION, "RowKey": _key_row(key_hash)}),
                    ]
                )

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
            rows = table.query_entities(
                "PartitionKey eq @p", parameters={"p": caller.limits_partition}, select=["PartitionKey", "RowKey"]
            )
            async for row in rows:
                with contextlib.suppress(ResourceNotFoundError):
                    await table.delete_entity(row["PartitionKey"], row["RowKey"])

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
                await table.submit_transaction(
                    [
                        (
                            "update",
                            _entity(_caller_row(name), rotated, new_hash),
                            {"mode": UpdateMode.REPLACE, "etag": etag, _IF_MATCH: MatchConditions.IfNotModified},
                        ),
                        ("delete", {"PartitionKey": PARTITION, "RowKey": _key_row(old_hash)}),
                        ("create", _entity(_key_row(new_hash), rotated, new_hash)),
                    ]
                )

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
