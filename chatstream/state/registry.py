"""The registry in the store (``Registry``): callers and their keys, teams, prices. The admin API
creates, lists, reads, changes and deletes them (manage.py); the request path asks ``authenticate``
for every caller key, ``team_of`` for its team and ``price`` for its model, each answer cached per
instance for ``cache_seconds``: a revoked or rotated key, a changed limit, a new price take effect on
every instance within that time, exactly, and cost a store read only once per key, team or model,
instance and period (in the last ``AHEAD`` of it, a request that uses the answer has it read again in
the background: a key, team or model in steady use is never read on a request's path).

Table ``chatstreamCallers``:

- partition ``callers``: ``c|<name>`` the caller (limits, models, team, expiry, created, key hash and
  hint) and ``k|<sha256 of the key>`` the key index, holding a copy of the caller, so that a key check
  is one point read. Create, update, rotate and delete change both rows in one entity-group
  transaction, the caller row under its ETag (two admins patching at once do not lose an update).
- partition ``teams``: ``t|<name>`` a team. A team that still has callers cannot be deleted.
- partition ``prices``: ``p|<model>`` a model's price.

Made-up keys cost nothing much: a key that cannot be one of ours is refused without a store read,
and a well-shaped key this instance has not seen is looked up at most ``LOOKUPS_PER_SECOND`` times a
second (a flood of made-up keys waits its turn, answered "unavailable, retry", instead of taking the
store from the callers whose keys are known)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..errors import AlreadyExists, Modified, NotFound, StoreError, log_safe
from .callers import (
    KEY_SHAPE,
    LIMIT_FIELDS,
    NAME_PATTERN,
    Caller,
    CallerPatch,
    CallerSpec,
    Stored,
    Team,
    TeamPatch,
    TeamSpec,
    as_row,
    hash_key,
    new_key,
    of_row,
)
from .port import Conflict, Invalid, KeyRefused, Missing, Unavailable
from .prices import Price, PriceSpec
from .store import CALLERS_TABLE, LIMITS_TABLE, Op, OpKind, Row, Store, Where, key_part

log = logging.getLogger("chatstream")
T = TypeVar("T")
Owner = TypeVar("Owner", Caller, Team)

CALLERS, TEAMS, PRICES = "callers", "teams", "prices"
_PLACE: dict[type, tuple[str, str]] = {Caller: (CALLERS, "c|"), Team: (TEAMS, "t|"), Price: (PRICES, "p|")}
AHEAD = 0.2  # of an answer's time: in its last part, a request that uses it has it read again, in the background
AHEAD_DELAY = 0.02  # ...starting this much later: the request's upstream call goes out first, not behind the read
MAX_CACHED = 10_000  # answers (callers, teams, prices, and "no such key") kept per instance, least recent dropped
ADMIN_TIMEOUT = 10.0  # an admin call is not on a request's path: it may wait for a busy store
LOOKUPS_PER_SECOND = 50.0  # store reads for keys this instance has not seen, at most
_TRIES = 5  # an admin change that meets another admin's: read again and reapply this often


def _row_key(cls: type, name: str) -> str:
    """The row of a caller, team or price: ``c|<name>``, ``t|<name>``, ``p|<model>``."""
    return _PLACE[cls][1] + key_part(name)  # a caller's or team's name is its own key part


def _entity(value: Caller | Team | Price) -> dict[str, Any]:
    name = value.model if isinstance(value, Price) else value.name
    return {"PartitionKey": _PLACE[type(value)][0], "RowKey": _row_key(type(value), name), **as_row(value)}


def _ops(kind: OpKind, owner: Caller | Team, key_hash: str = "", etag: str | None = None) -> list[Op]:
    """The operations that insert, replace or delete a team's row (under ``etag``), or a caller's
    row (under ``etag``) and its key index, a copy of it: one entity-group transaction for both."""
    row = _entity(owner) | ({"key_hash": key_hash} if key_hash else {})
    index = [Op(kind, {**row, "RowKey": f"k|{key_hash}"})] if key_hash else []
    return [Op(kind, row, etag=etag), *index]


class _Cache:
    """Answers kept per instance for ``seconds`` (from when they were asked for), by row key (a key
    index's, team's or price's), one store read at a time per row: concurrent first requests share it."""

    def __init__(self, seconds: float, clock: Callable[[], float], size: int = MAX_CACHED):
        self.seconds = seconds
        self.clock = clock
        self.size = size
        self._kept: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    def known(self, key: str) -> bool:
        """Whether ``key`` is being read now, an earlier read found it (its answer may be stale), or
        an answer (even "none") is kept in its time."""
        kept = self._kept.get(key)
        return key in self._pending or (kept is not None and (kept[1] is not None or kept[0] > self.clock()))

    def fresh(self, key: str) -> tuple[bool, Any]:
        """Whether an answer for ``key`` is kept in its time (``get`` answers it at once), and it."""
        kept = self._kept.get(key)
        if kept is not None and kept[0] > self.clock():
            self._kept.move_to_end(key)
            return True, kept[1]
        return False, None

    async def get(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
        found, value = self.fresh(key)
        if found:
            self._ahead(key, read)
            return value
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._read(key, read))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    def _ahead(self, key: str, read: Callable[[], Awaitable[Any]]) -> None:
        """An answer in the last ``AHEAD`` of its time is read again in the background (``AHEAD_DELAY``
        after the request that found it, whose upstream call goes first), so that a key
        (team, model) in steady use is never read on a request's path; the answer in use is still at
        most ``seconds`` old (from when it was asked for)."""
        kept = self._kept.get(key)
        if kept is None or key in self._pending or kept[0] - self.clock() > self.seconds * AHEAD:
            return
        pending = self._pending[key] = asyncio.ensure_future(self._read(key, read, AHEAD_DELAY))

        def done(future: asyncio.Future) -> None:
            self._pending.pop(key, None)
            if not future.cancelled() and future.exception() is not None:  # the next request reads it
                log.warning("caller store: a cached answer could not be read again ahead: %s", future.exception())

        pending.add_done_callback(done)

    async def _read(self, key: str, read: Callable[[], Awaitable[Any]], delay: float = 0.0) -> Any:
        if delay:
            await asyncio.sleep(delay)
        asked = self.clock()  # kept from when it was asked for: a change after that takes effect
        value = await read()  # at most ``seconds`` after it was made, exactly
        self._kept[key] = (asked + self.seconds, value)
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._evict()
        return value

    def _evict(self) -> None:
        """The least recent "no such key" goes first: a flood of made-up keys does not push the
        known callers out (their next request would pay a store read, and the flood's bucket)."""
        for key, (_, value) in self._kept.items():
            if value is None:
                del self._kept[key]
                return
        self._kept.popitem(last=False)

    def forget(self, key: str) -> None:
        self._kept.pop(key, None)


class Registry:
    """Callers, teams and prices in the store (module docstring)."""

    def __init__(self, store: Store, cache_seconds: float = 10.0, clock: Callable[[], float] | None = None):
        self.store = store
        self.clock = clock or store.clock.now
        self.cache = _Cache(cache_seconds, self.clock)
        self._bucket = LOOKUPS_PER_SECOND
        self._bucket_at = time.monotonic()

    # --- the request path -----------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> Caller | KeyRefused | Unavailable:
        """The caller whose key this is; KeyRefused (unknown, revoked, rotated, expired); Unavailable
        when the store must be asked and does not answer (or too many unknown keys are asked now)."""
        if not isinstance(key, str) or not KEY_SHAPE.fullmatch(key):
            return KeyRefused()  # not one of ours: no store read, nothing cached
        index = f"k|{hash_key(key)}"
        # Only a key nobody is reading now and no read found counts against the bucket: a known
        # caller's burst, as its cached answer runs out, is not a flood of made-up keys.
        if not self.cache.known(index) and not self._may_look_up():
            return Unavailable()  # too many unknown keys are being checked now
        caller = await self._cached(Caller, index, "key check")
        if caller is None:
            return KeyRefused()
        if isinstance(caller, Caller) and caller.expired(self.clock()):
            return KeyRefused(expired=True)
        return caller

    def _may_look_up(self) -> bool:
        now = time.monotonic()
        self._bucket = min(2 * LOOKUPS_PER_SECOND, self._bucket + (now - self._bucket_at) * LOOKUPS_PER_SECOND)
        self._bucket_at = now
        if self._bucket < 1:
            return False
        self._bucket -= 1
        return True

    async def _cached(self, cls: type[Stored], row_key: str, what: str) -> Stored | Unavailable | None:
        """The ``cls`` in row ``row_key`` (None: none), from the cache or read into it."""

        async def read() -> Stored | None:
            row = await self.store.get(CALLERS_TABLE, _PLACE[cls][0], row_key, timeout=self.store.clock.patience())
            return of_row(cls, row) if row is not None else None

        try:
            return await self.cache.get(row_key, read)
        except StoreError as exc:
            log.warning("caller store: %s failed: %s", what, exc)
            return Unavailable()

    async def team_of(self, caller: Caller) -> Team | Unavailable | None:
        """The caller's team (None: it has none, or it is gone: a team with callers cannot be
        deleted, so only a race leaves one without it), cached like keys."""
        if caller.team is None:
            return None
        team = await self._cached(Team, _row_key(Team, caller.team), "team read")
        if team is None or (isinstance(team, Team) and team.id != caller.team_id):
            log.warning("caller %s: its team %s is gone; its team limits do not apply", caller.name, caller.team)
            return None
        return team

    async def team_and_price(
        self, caller: Caller, model: str
    ) -> tuple[Team | Unavailable | None, Price | Unavailable | None]:
        """The caller's team and the model's price: one after the other when both are cached (no
        task, no loop hop on the request's path), else both reads at once."""
        fresh = self.cache.fresh
        if fresh(_row_key(Price, model))[0] and (caller.team is None or fresh(_row_key(Team, caller.team))[0]):
            return await self.team_of(caller), await self.price(model)
        team, price = await asyncio.gather(self.team_of(caller), self.price(model))
        return team, price

    def price_kept(self, model: str) -> Price | None:
        """The model's price as this instance keeps it now, without a store read (None: none kept)."""
        found, price = self.cache.fresh(_row_key(Price, model))
        return price if found and isinstance(price, Price) else None

    async def price(self, model: str) -> Price | Unavailable | None:
        """The model's price (None: it has none), cached like keys."""
        return await self._cached(Price, _row_key(Price, model), "price read")

    async def caller_by_id(self, caller_id: str) -> Caller | Unavailable | None:
        """The caller with this id (None: gone), for a stream taken over (its record names its owner
        by id). A scan of the callers: rare, and bounded by the number of callers."""
        try:
            found = await self._all(Caller, {"id": caller_id}, self.store.clock.patience())
        except StoreError:
            return Unavailable()
        return found[0] if found else None

    # --- the admin API: callers and teams -------------------------------------------------------

    async def _get(self, cls: type, name: str) -> Row | None:
        return await self.store.get(CALLERS_TABLE, _PLACE[cls][0], _row_key(cls, name), timeout=ADMIN_TIMEOUT)

    async def _all(self, cls: type[Stored], equal: dict | None = None, bound: float = ADMIN_TIMEOUT) -> list[Stored]:
        """Every caller, team or price (with the properties ``equal``)."""
        partition, prefix = _PLACE[cls]
        where = Where(partition=partition, rows_from=prefix, rows_to=prefix[:-1] + "}", equal=equal or {})
        return [of_row(cls, row) for row in await self.store.query(CALLERS_TABLE, where, timeout=bound)]

    async def _write(self, ops: list[Op]) -> None:
        """Write ``ops`` (one transaction); what this instance kept of their rows is dropped."""
        await self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT)
        for op in ops:
            self.cache.forget(op.entity["RowKey"])

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    def _future(self, expires_at: datetime | None) -> None:
        if expires_at is not None and expires_at.timestamp() <= self.clock():
            raise Invalid("expires_at: must be in the future", "expires_at")

    async def _team_ref(self, name: str | None) -> tuple[str | None, str | None]:
        if name is None:
            return None, None
        row = await self._get(Team, name)
        if row is None:
            raise Invalid(f"team: no team named {name!r}", "team")
        return name, row["id"]

    async def _insert(self, owner: Caller | Team, key_hash: str = "") -> None:
        try:
            await self._write(_ops("insert", owner, key_hash))
        except AlreadyExists:
            kind = type(owner).__name__.lower()
            raise Invalid(f"name: a {kind} named {owner.name!r} already exists", "name") from None

    async def _load(self, cls: type[Owner], name: object) -> tuple[Owner, str, str]:
        """The caller or team ``name``, its key hash (a caller's) and its row's ETag; Missing when
        there is none."""
        kind = cls.__name__.lower()
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise Missing(kind, log_safe(name if isinstance(name, str) else "")[:80])
        row = await self._get(cls, name)
        if row is None:
            raise Missing(kind, name)
        return of_row(cls, row), row.get("key_hash") or "", row.etag

    async def _change(
        self,
        cls: type[Owner],
        name: str,
        doing: str,
        change: Callable[[Owner, str, str], Awaitable[tuple[list[Op], T]]],
    ) -> T:
        """Read the caller or team ``name``, write the operations ``change`` makes of it (under its
        row's ETag), and again when another admin's change came in between, ``_TRIES`` times."""
        for _ in range(_TRIES):
            owner, key_hash, etag = await self._load(cls, name)
            ops, result = await change(owner, key_hash, etag)
            try:
                await self._write(ops)
            except (Modified, NotFound, AlreadyExists):
                continue  # another admin's change in between: read again and reapply
            return result
        raise Conflict(f"the {cls.__name__.lower()} changed repeatedly while {doing}; try again")

    async def _update(self, cls: type[Owner], name: str, data: CallerPatch | TeamPatch) -> Owner:
        given = data.model_fields_set
        if isinstance(data, CallerPatch) and "expires_at" in given:
            self._future(data.expires_at)

        async def change(owner: Owner, key_hash: str, etag: str) -> tuple[list[Op], Owner]:
            values = data.values(given)
            if isinstance(data, CallerPatch) and "team" in given:
                values["team"], values["team_id"] = await self._team_ref(data.team)
            updated = replace(owner, **values)
            return _ops("replace", updated, key_hash, etag), updated

        updated = await self._change(cls, name, "being updated", change)
        log.info("%s %s updated (%s)", cls.__name__.lower(), name, ", ".join(sorted(given)) or "nothing")
        return updated

    async def _delete(self, cls: type[Owner], name: str) -> Owner:
        """Remove the caller or team and, best effort, its limit counters (harmless if it fails: one
        created again under this name gets a new id)."""

        async def change(owner: Owner, key_hash: str, etag: str) -> tuple[list[Op], Owner]:
            if isinstance(owner, Team):
                members = [c.name for c in await self.list() if c.team == name]
                if members:
                    raise Conflict(f"team {name!r} still has {len(members)} caller(s): move or delete them first")
            return _ops("delete", owner, key_hash, etag), owner

        owner = await self._change(cls, name, "being deleted", change)
        try:
            partition = owner.limits_partition
            for row in await self.store.query(
                LIMITS_TABLE, Where(partition=partition, select=()), timeout=ADMIN_TIMEOUT
            ):
                await self.store.delete(LIMITS_TABLE, partition, row["RowKey"])
        except StoreError as exc:
            log.warning("%s %s deleted; its limit counters were left in the store: %s", cls.__name__.lower(), name, exc)
        log.info("%s %s deleted", cls.__name__.lower(), name)
        return owner

    async def create(self, data: CallerSpec) -> tuple[Caller, str]:
        """A new caller and its key (shown this once)."""
        self._future(data.expires_at)
        team, team_id = await self._team_ref(data.team)
        key = new_key()
        caller = Caller(
            name=data.name,
            id=secrets.token_hex(6),
            team=team,
            team_id=team_id,
            **data.values(LIMIT_FIELDS),
            expires_at=data.expires_at,
            created_at=self._now(),
            key_hint=key[-4:],
        )
        await self._insert(caller, hash_key(key))
        log.info("caller %s created (key …%s)", caller.name, caller.key_hint)
        return caller, key

    async def list(self) -> list[Caller]:
        return sorted(await self._all(Caller), key=lambda c: c.name)

    async def get(self, name: str) -> Caller:
        return (await self._load(Caller, name))[0]

    async def update(self, name: str, patch: CallerPatch) -> Caller:
        """Change the fields ``patch`` names; the key stays."""
        return await self._update(Caller, name, patch)

    async def delete(self, name: str) -> Caller:
        """Remove the caller and its key (which stops working on every instance within
        ``cache_seconds``), and its limit counters."""
        return await self._delete(Caller, name)

    async def rotate(self, name: str) -> tuple[Caller, str]:
        """A new key for the caller; the old one stops working (on every instance within
        ``cache_seconds``). Limits, usage and counters stay."""
        key = new_key()

        async def change(caller: Caller, old_hash: str, etag: str) -> tuple[list[Op], Caller]:
            rotated = replace(caller, key_hint=key[-4:])
            row, index = _ops("replace", rotated, hash_key(key), etag)
            return [
                row,
                Op("delete", {"PartitionKey": CALLERS, "RowKey": f"k|{old_hash}"}),
                replace(index, kind="insert"),
            ], rotated

        rotated = await self._change(Caller, name, "its key was rotated", change)
        log.info("caller %s: key rotated (now …%s)", name, rotated.key_hint)
        return rotated, key

    async def create_team(self, data: TeamSpec) -> Team:
        team = Team(name=data.name, id=secrets.token_hex(6), **data.values(LIMIT_FIELDS), created_at=self._now())
        await self._insert(team)
        log.info("team %s created", team.name)
        return team

    async def list_teams(self) -> list[Team]:
        return sorted(await self._all(Team), key=lambda t: t.name)

    async def get_team(self, name: str) -> Team:
        return (await self._load(Team, name))[0]

    async def update_team(self, name: str, patch: TeamPatch) -> Team:
        return await self._update(Team, name, patch)

    async def delete_team(self, name: str) -> Team:
        """Remove a team that has no callers (Conflict otherwise: move or delete them first)."""
        return await self._delete(Team, name)

    # --- the admin API: prices ------------------------------------------------------------------

    async def set_price(self, model: str, data: PriceSpec) -> Price:
        if not isinstance(model, str) or not 0 < len(model) <= 256 or model != model.strip() or not model.isprintable():
            raise Invalid("model: not a model name", "model")
        price = data.price(model, self._now())
        await self.store.upsert(CALLERS_TABLE, _entity(price), timeout=ADMIN_TIMEOUT)
        self.cache.forget(_row_key(Price, model))
        log.info("price of %s set", log_safe(model)[:80])
        return price

    async def list_prices(self) -> list[Price]:
        return sorted(await self._all(Price), key=lambda p: p.model)

    async def get_price(self, model: str) -> Price:
        row = await self._get(Price, model) if model else None
        if row is None:
            raise Missing("price for model", log_safe(model)[:80])
        return of_row(Price, row)

    async def delete_price(self, model: str) -> Price:
        price = await self.get_price(model)
        await self.store.delete(CALLERS_TABLE, PRICES, _row_key(Price, model), timeout=ADMIN_TIMEOUT)
        self.cache.forget(_row_key(Price, model))
        return price
