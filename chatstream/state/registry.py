"""The registry in the store (``Registry``): callers and their keys, teams, prices. The admin API
creates, lists, reads, changes and deletes them (manage.py); the request path asks ``authenticate``
for every caller key, ``team`` for its team and ``price`` for its model, each answer cached per
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
from collections.abc import Awaitable, Callable, Iterable, Mapping
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
    Team,
    TeamPatch,
    TeamSpec,
    hash_key,
    iso,
    limits_entity,
    limits_fields,
    model_limits_of,
    new_key,
    spend_pico,
    validate,
)
from .port import AdminUnavailable, Conflict, Invalid, KeyRefused, Missing, Unavailable
from .prices import Price, PriceSpec
from .store import CALLERS_TABLE, LIMITS_TABLE, Op, Row, Store, Where, key_part

log = logging.getLogger("chatstream")
T = TypeVar("T")

CALLERS, TEAMS, PRICES = "callers", "teams", "prices"
AHEAD = 0.2  # of an answer's time: in its last part, a request that uses it has it read again, in the background
AHEAD_DELAY = 0.02  # ...starting this much later: the request's upstream call goes out first, not behind the read
MAX_CACHED = 10_000  # answers (callers, teams, prices, and "no such key") kept per instance, least recent dropped
ADMIN_TIMEOUT = 10.0  # an admin call is not on a request's path: it may wait for a busy store
LOOKUPS_PER_SECOND = 50.0  # store reads for keys this instance has not seen, at most
_TRIES = 5  # an admin change that meets another admin's: read again and reapply this often


def _caller_entity(row_key: str, caller: Caller, key_hash: str) -> dict[str, Any]:
    return {
        "PartitionKey": CALLERS,
        "RowKey": row_key,
        "name": caller.name,
        "id": caller.id,
        "team": caller.team,
        "team_id": caller.team_id,
        **limits_entity(caller),
        "expires_at": iso(caller.expires_at),
        "created_at": iso(caller.created_at),
        "key_hash": key_hash,
        "key_hint": caller.key_hint,
    }


def _caller(entity: Mapping[str, Any]) -> Caller:
    expires = entity.get("expires_at")
    return Caller(
        name=entity["name"],
        id=entity["id"],
        team=entity.get("team") or None,
        team_id=entity.get("team_id") or None,
        **limits_fields(entity),
        expires_at=datetime.fromisoformat(expires) if expires else None,
        created_at=datetime.fromisoformat(entity["created_at"]),
        key_hint=entity.get("key_hint", ""),
    )


def _team_entity(team: Team) -> dict[str, Any]:
    return {
        "PartitionKey": TEAMS,
        "RowKey": f"t|{team.name}",
        "name": team.name,
        "id": team.id,
        **limits_entity(team),
        "created_at": iso(team.created_at),
    }


def _team(entity: Mapping[str, Any]) -> Team:
    return Team(
        name=entity["name"],
        id=entity["id"],
        **limits_fields(entity),
        created_at=datetime.fromisoformat(entity["created_at"]),
    )


def _price_row(model: str) -> str:
    return f"p|{key_part(model)}"


class _Cache:
    """Answers kept per instance for ``seconds`` (from when they were asked for), one store read at
    a time per key: concurrent first requests share it."""

    def __init__(self, seconds: float, clock: Callable[[], float], size: int = MAX_CACHED):
        self.seconds = seconds
        self.clock = clock
        self.size = size
        self._kept: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    def known(self, key: str) -> bool:
        """Whether ``key`` is being read now, or an earlier read found it (its answer may be stale)."""
        kept = self._kept.get(key)
        return key in self._pending or (kept is not None and kept[1] is not None)

    def holds(self, key: str) -> bool:
        """Whether an answer for ``key`` is kept and still in its time (``get`` answers it at once)."""
        kept = self._kept.get(key)
        return kept is not None and kept[0] > self.clock()

    def fresh(self, key: str) -> tuple[bool, Any]:
        kept = self._kept.get(key)
        if kept is not None and kept[0] > self.clock():
            self._kept.move_to_end(key)
            return True, kept[1]
        return False, None

    async def get(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
        found, value = self.fresh(key)
        if found:
            self.ahead(key, read)
            return value
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._read(key, read))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    def ahead(self, key: str, read: Callable[[], Awaitable[Any]]) -> None:
        """An answer in the last ``AHEAD`` of its time is read again in the background (``AHEAD_DELAY``
        after the request that found it, whose upstream call goes first), so that a key
        (team, model) in steady use is never read on a request's path; the answer in use is still at
        most ``seconds`` old (from when it was asked for)."""
        kept = self._kept.get(key)
        if kept is None or key in self._pending or kept[0] - self.clock() > self.seconds * AHEAD:
            return
        pending = self._pending[key] = asyncio.ensure_future(self._read_later(key, read))

        def done(future: asyncio.Future) -> None:
            self._pending.pop(key, None)
            if not future.cancelled() and future.exception() is not None:  # the next request reads it
                log.warning("caller store: a cached answer could not be read again ahead: %s", future.exception())

        pending.add_done_callback(done)

    async def _read_later(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
        await asyncio.sleep(AHEAD_DELAY)
        return await self._read(key, read)

    async def _read(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
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
        self.keys = _Cache(cache_seconds, self.clock)
        self.teams = _Cache(cache_seconds, self.clock)
        self.prices = _Cache(cache_seconds, self.clock)
        self.store_reads = 0  # key lookups that reached the store (tests and docs/callers.md use it)
        self._bucket = LOOKUPS_PER_SECOND
        self._bucket_at = time.monotonic()

    # --- the request path -----------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> Caller | KeyRefused | Unavailable:
        """The caller whose key this is; KeyRefused (unknown, revoked, rotated, expired); Unavailable
        when the store must be asked and does not answer (or too many unknown keys are asked now)."""
        if not isinstance(key, str) or not KEY_SHAPE.fullmatch(key):
            return KeyRefused()  # not one of ours: no store read, nothing cached
        key_hash = hash_key(key)
        known, caller = self.keys.fresh(key_hash)
        if known:
            self.keys.ahead(key_hash, lambda: self._read_key(key_hash))
        else:
            # Only a key nobody is reading now and no read found counts against the bucket: a known
            # caller's burst, as its cached answer runs out, is not a flood of made-up keys.
            if not self.keys.known(key_hash) and not self._may_look_up():
                return Unavailable()  # too many unknown keys are being checked now
            try:
                caller = await self.keys.get(key_hash, lambda: self._read_key(key_hash))
            except StoreError as exc:
                log.warning("caller store: key check failed: %s", exc)
                return Unavailable()
        if caller is None:
            return KeyRefused()
        if caller.expired(self.clock()):
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

    async def _read_key(self, key_hash: str) -> Caller | None:
        self.store_reads += 1
        row = await self.store.get(CALLERS_TABLE, CALLERS, f"k|{key_hash}", timeout=self.store.clock.patience())
        return _caller(row) if row is not None else None

    async def team_of(self, caller: Caller) -> Team | Unavailable | None:
        """The caller's team (None: it has none, or it is gone: a team with callers cannot be
        deleted, so only a race leaves one without it), cached like keys."""
        if caller.team is None:
            return None
        try:
            team = await self.teams.get(caller.team, lambda: self._read_team(caller.team or ""))
        except StoreError as exc:
            log.warning("caller store: team read failed: %s", exc)
            return Unavailable()
        if team is None or team.id != caller.team_id:
            log.warning("caller %s: its team %s is gone; its team limits do not apply", caller.name, caller.team)
            return None
        return team

    async def _read_team(self, name: str) -> Team | None:
        row = await self.store.get(CALLERS_TABLE, TEAMS, f"t|{name}", timeout=self.store.clock.patience())
        return _team(row) if row is not None else None

    async def team_and_price(
        self, caller: Caller, model: str
    ) -> tuple[Team | Unavailable | None, Price | Unavailable | None]:
        """The caller's team and the model's price: one after the other when both are cached (no
        task, no loop hop on the request's path), else both reads at once."""
        if self.prices.holds(model) and (caller.team is None or self.teams.holds(caller.team)):
            return await self.team_of(caller), await self.price(model)
        team, price = await asyncio.gather(self.team_of(caller), self.price(model))
        return team, price

    def price_kept(self, model: str) -> Price | None:
        """The model's price as this instance keeps it now, without a store read (None: none kept)."""
        found, price = self.prices.fresh(model)
        return price if found and isinstance(price, Price) else None

    async def price(self, model: str) -> Price | Unavailable | None:
        """The model's price (None: it has none), cached like keys."""
        try:
            return await self.prices.get(model, lambda: self._read_price(model))
        except StoreError as exc:
            log.warning("caller store: price read failed: %s", exc)
            return Unavailable()

    async def _read_price(self, model: str) -> Price | None:
        row = await self.store.get(CALLERS_TABLE, PRICES, _price_row(model), timeout=self.store.clock.patience())
        return Price.of(row) if row is not None else None

    # --- the admin API ------------------------------------------------------------------------

    async def _admin(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except (AlreadyExists, Modified, NotFound):
            raise
        except StoreError as exc:
            log.warning("caller store: an admin operation failed: %s", exc)
            raise AdminUnavailable(str(exc)) from None

    def _future(self, expires_at: datetime | None) -> None:
        if expires_at is not None and expires_at.timestamp() <= self.clock():
            raise Invalid("expires_at: must be in the future", "expires_at")

    async def _team_ref(self, name: str | None) -> tuple[str | None, str | None]:
        if name is None:
            return None, None
        row = await self._admin(self.store.get(CALLERS_TABLE, TEAMS, f"t|{name}", timeout=ADMIN_TIMEOUT))
        if row is None:
            raise Invalid(f"team: no team named {name!r}", "team")
        return name, row["id"]

    async def create(self, spec: object) -> tuple[Caller, str]:
        """A new caller and its key (shown this once)."""
        data: CallerSpec = validate(CallerSpec, spec)
        self._future(data.expires_at)
        team, team_id = await self._team_ref(data.team)
        key = new_key()
        caller = Caller(
            name=data.name,
            id=secrets.token_hex(6),
            team=team,
            team_id=team_id,
            **_changes(data, LIMIT_FIELDS),
            expires_at=data.expires_at,
            created_at=datetime.fromtimestamp(self.clock(), UTC),
            key_hint=key[-4:],
        )
        key_hash = hash_key(key)
        ops = [
            Op("insert", _caller_entity(f"c|{caller.name}", caller, key_hash)),
            Op("insert", _caller_entity(f"k|{key_hash}", caller, key_hash)),
        ]
        try:
            await self._admin(self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT))
        except AlreadyExists:
            raise Invalid(f"name: a caller named {caller.name!r} already exists", "name") from None
        self.keys.forget(key_hash)
        log.info("caller %s created (key …%s)", caller.name, caller.key_hint)
        return caller, key

    async def list(self) -> list[Caller]:
        rows = await self._admin(
            self.store.query(
                CALLERS_TABLE, Where(partition=CALLERS, rows_from="c|", rows_to="c}"), timeout=ADMIN_TIMEOUT
            )
        )
        return sorted((_caller(row) for row in rows), key=lambda c: c.name)

    async def _named(self, kind: str, partition: str, prefix: str, name: object) -> Row:
        """The row of the caller or team ``name``; Missing when there is none."""
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise Missing(kind, log_safe(name if isinstance(name, str) else "")[:80])
        row = await self._admin(self.store.get(CALLERS_TABLE, partition, prefix + name, timeout=ADMIN_TIMEOUT))
        if row is None:
            raise Missing(kind, name)
        return row

    async def _row(self, name: str) -> tuple[Caller, str, str]:
        """The caller row: the caller, its key hash and its ETag."""
        row = await self._named("caller", CALLERS, "c|", name)
        return _caller(row), row["key_hash"], row.etag

    async def get(self, name: str) -> Caller:
        return (await self._row(name))[0]

    async def caller_by_id(self, caller_id: str) -> Caller | Unavailable | None:
        """The caller with this id (None: gone), for a stream taken over (its record names its owner
        by id). A scan of the callers: rare, and bounded by the number of callers."""
        try:
            rows = await self.store.query(
                CALLERS_TABLE,
                Where(partition=CALLERS, rows_from="c|", rows_to="c}", equal={"id": caller_id}),
                timeout=self.store.clock.patience(),
            )
        except StoreError:
            return Unavailable()
        return _caller(rows[0]) if rows else None

    async def update(self, name: str, patch: object) -> Caller:
        """Change the fields ``patch`` names; the key stays."""
        data: CallerPatch = validate(CallerPatch, patch)
        given = data.model_fields_set
        if "expires_at" in given:
            self._future(data.expires_at)
        for _ in range(_TRIES):
            caller, key_hash, etag = await self._row(name)
            changes = _changes(data, given)
            if "team" in given:
                changes["team"], changes["team_id"] = await self._team_ref(data.team)
            updated = replace(caller, **changes)
            ops = [
                Op("replace", _caller_entity(f"c|{name}", updated, key_hash), etag=etag),
                Op("replace", _caller_entity(f"k|{key_hash}", updated, key_hash)),
            ]
            try:
                await self._admin(self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT))
            except (Modified, NotFound):
                continue  # another admin's change in between: read again and reapply
            self.keys.forget(key_hash)
            log.info("caller %s updated (%s)", name, ", ".join(sorted(given)) or "nothing")
            return updated
        raise Conflict("the caller changed repeatedly while being updated; try again")

    async def delete(self, name: str) -> Caller:
        """Remove the caller and its key (which stops working on every instance within
        ``cache_seconds``), and, best effort, its limit counters."""
        for _ in range(_TRIES):
            caller, key_hash, etag = await self._row(name)
            ops = [
                Op("delete", {"PartitionKey": CALLERS, "RowKey": f"c|{name}"}, etag=etag),
                Op("delete", {"PartitionKey": CALLERS, "RowKey": f"k|{key_hash}"}),
            ]
            try:
                await self._admin(self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT))
            except (Modified, NotFound):
                continue
            self.keys.forget(key_hash)
            await self._drop_counters(caller.limits_partition, caller.name)
            log.info("caller %s deleted", name)
            return caller
        raise Conflict("the caller changed repeatedly while being deleted; try again")

    async def _drop_counters(self, partition: str, name: str) -> None:
        """Harmless if it fails: a caller or team created again under this name gets a new id."""
        try:
            for row in await self.store.query(
                LIMITS_TABLE, Where(partition=partition, select=()), timeout=ADMIN_TIMEOUT
            ):
                await self.store.delete(LIMITS_TABLE, partition, row["RowKey"])
        except StoreError as exc:
            log.warning("%s deleted; its limit counters were left in the store: %s", name, exc)

    async def rotate(self, name: str) -> tuple[Caller, str]:
        """A new key for the caller; the old one stops working (on every instance within
        ``cache_seconds``). Limits, usage and counters stay."""
        for _ in range(_TRIES):
            caller, old_hash, etag = await self._row(name)
            key = new_key()
            new_hash = hash_key(key)
            rotated = replace(caller, key_hint=key[-4:])
            ops = [
                Op("replace", _caller_entity(f"c|{name}", rotated, new_hash), etag=etag),
                Op("delete", {"PartitionKey": CALLERS, "RowKey": f"k|{old_hash}"}),
                Op("insert", _caller_entity(f"k|{new_hash}", rotated, new_hash)),
            ]
            try:
                await self._admin(self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT))
            except (Modified, NotFound, AlreadyExists):
                continue
            self.keys.forget(old_hash)
            log.info("caller %s: key rotated (now …%s)", name, rotated.key_hint)
            return rotated, key
        raise Conflict("the caller changed repeatedly while its key was rotated; try again")

    # --- teams --------------------------------------------------------------------------------

    async def create_team(self, spec: object) -> Team:
        data: TeamSpec = validate(TeamSpec, spec)
        team = Team(
            name=data.name,
            id=secrets.token_hex(6),
            **_changes(data, LIMIT_FIELDS),
            created_at=datetime.fromtimestamp(self.clock(), UTC),
        )
        try:
            await self._admin(self.store.insert(CALLERS_TABLE, _team_entity(team), timeout=ADMIN_TIMEOUT))
        except AlreadyExists:
            raise Invalid(f"name: a team named {team.name!r} already exists", "name") from None
        self.teams.forget(team.name)
        log.info("team %s created", team.name)
        return team

    async def list_teams(self) -> list[Team]:
        rows = await self._admin(self.store.query(CALLERS_TABLE, Where(partition=TEAMS), timeout=ADMIN_TIMEOUT))
        return sorted((_team(row) for row in rows), key=lambda t: t.name)

    async def _team_row(self, name: str) -> tuple[Team, str]:
        row = await self._named("team", TEAMS, "t|", name)
        return _team(row), row.etag

    async def get_team(self, name: str) -> Team:
        return (await self._team_row(name))[0]

    async def update_team(self, name: str, patch: object) -> Team:
        data: TeamPatch = validate(TeamPatch, patch)
        given = data.model_fields_set
        for _ in range(_TRIES):
            team, etag = await self._team_row(name)
            updated = replace(team, **_changes(data, given))
            try:
                await self._admin(
                    self.store.replace(CALLERS_TABLE, _team_entity(updated), etag=etag, timeout=ADMIN_TIMEOUT)
                )
            except (Modified, NotFound):
                continue
            self.teams.forget(name)
            log.info("team %s updated (%s)", name, ", ".join(sorted(given)) or "nothing")
            return updated
        raise Conflict("the team changed repeatedly while being updated; try again")

    async def delete_team(self, name: str) -> Team:
        """Remove a team that has no callers (Conflict otherwise: move or delete them first)."""
        team, etag = await self._team_row(name)
        members = [c.name for c in await self.list() if c.team == name]
        if members:
            raise Conflict(f"team {name!r} still has {len(members)} caller(s): move or delete them first")
        try:
            await self._admin(self.store.delete(CALLERS_TABLE, TEAMS, f"t|{name}", etag=etag, timeout=ADMIN_TIMEOUT))
        except Modified:
            raise Conflict("the team changed while being deleted; try again") from None
        self.teams.forget(name)
        await self._drop_counters(team.limits_partition, f"team {name}")
        log.info("team %s deleted", name)
        return team

    # --- prices -------------------------------------------------------------------------------

    async def set_price(self, model: str, spec: object) -> Price:
        if (
            not isinstance(model, str)
            or not model
            or len(model) > 256
            or model != model.strip()
            or not model.isprintable()
        ):
            raise Invalid("model: not a model name", "model")
        data: PriceSpec = validate(PriceSpec, spec)
        price = data.price(model, datetime.fromtimestamp(self.clock(), UTC))
        entity = {"PartitionKey": PRICES, "RowKey": _price_row(model), **price.entity()}
        await self._admin(self.store.upsert(CALLERS_TABLE, entity, timeout=ADMIN_TIMEOUT))
        self.prices.forget(model)
        log.info("price of %s set", log_safe(model)[:80])
        return price

    async def list_prices(self) -> list[Price]:
        rows = await self._admin(self.store.query(CALLERS_TABLE, Where(partition=PRICES), timeout=ADMIN_TIMEOUT))
        return sorted((Price.of(row) for row in rows), key=lambda p: p.model)

    async def get_price(self, model: str) -> Price:
        row = (
            await self._admin(self.store.get(CALLERS_TABLE, PRICES, _price_row(model), timeout=ADMIN_TIMEOUT))
            if model
            else None
        )
        if row is None:
            raise Missing("price for model", log_safe(model)[:80])
        return Price.of(row)

    async def delete_price(self, model: str) -> Price:
        price = await self.get_price(model)
        await self._admin(self.store.delete(CALLERS_TABLE, PRICES, _price_row(model), timeout=ADMIN_TIMEOUT))
        self.prices.forget(model)
        return price


def _changes(data: Any, given: Iterable[str]) -> dict[str, Any]:
    """A spec's or a patch's fields ``given`` as a caller's or team's values (``null`` removes; the
    period defaults): the one reading of what an admin said."""
    changes: dict[str, Any] = {f: getattr(data, f) for f in given if f != "team"}
    if "models" in changes and changes["models"] is not None:
        changes["models"] = tuple(changes["models"])
    if "spend_budget" in changes:
        changes["spend_budget"] = spend_pico(changes["spend_budget"])
    if "model_limits" in changes:
        changes["model_limits"] = model_limits_of(changes["model_limits"])
    if "budget_period" in changes and changes["budget_period"] is None:
        changes["budget_period"] = "total"
    return changes
