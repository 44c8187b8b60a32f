"""The registry in the store (``Registry``): callers and their keys, teams, prices. The admin API
(manage.py) keeps all three on one path, named by their class (``create``, ``list``, ``get``,
``update``, ``delete``; ``rotate`` a key, ``set_price``). A request asks ``authenticate`` for its
key's caller, then ``terms`` for its team and every model's price, each answer cached per instance
for ``cache_seconds``: a revoked or rotated key, a changed limit, a new price take effect on every
instance within that time, exactly, and cost a store read once per key, team or the prices, instance
and period (in the last ``AHEAD`` of it a request that uses the answer has it read again in the
background: an answer in steady use is never read on a request's path).

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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import unquote

from ..errors import AlreadyExists, Modified, NotFound, StoreError, log_safe
from . import counter_row
from .callers import (
    KEY_SHAPE,
    NAME_PATTERN,
    Caller,
    CallerPatch,
    CallerSpec,
    Team,
    TeamPatch,
    TeamSpec,
    hash_key,
    limits_partition,
    model_name,
    new_key,
)
from .port import Conflict, Invalid, KeyRefused, Missing, Unavailable, Unreadable
from .prices import Price, Prices, PriceSpec
from .store import CALLERS_TABLE, Op, OpKind, Row, Store, Where, key_part

log = logging.getLogger("chatstream")
T = TypeVar("T")
Kept = TypeVar("Kept", bound=Caller | Team | Price)

CALLERS, TEAMS, PRICES = "callers", "teams", "prices"
_PARTITION: dict[type, str] = {Caller: CALLERS, Team: TEAMS, Price: PRICES}
_PREFIX: dict[type, str] = {Caller: "c|", Team: "t|", Price: "p|"}  # of their row keys
AHEAD = 0.2  # of an answer's time: in its last part, a request that uses it has it read again, in the background
AHEAD_DELAY = 0.02  # ...starting this much later: the request's upstream call goes out first, not behind the read
MAX_CACHED = 10_000  # answers (callers, teams, prices, and "no such key") kept per instance, least recent dropped
ADMIN_TIMEOUT = 10.0  # an admin call is not on a request's path: it may wait for a busy store
LOOKUPS_PER_SECOND = 50.0  # store reads for keys this instance has not seen, at most
_TRIES = 5  # an admin change that meets another admin's: read again and reapply this often


def _row_key(cls: type, name: str) -> str:
    return _PREFIX[cls] + key_part(name)  # a caller's or team's name is its own key part


def _name_of(value: Caller | Team | Price | Unreadable) -> str:
    return value.model if isinstance(value, Price) else value.name


def _ops(kind: OpKind, owner: Caller | Team | Price, key_hash: str = "", etag: str | None = None) -> list[Op]:
    """The operations that write (``kind``) a team's or price's row (under ``etag``), or a caller's
    row (under ``etag``) and its key index, a copy of it: one entity-group transaction."""
    row = {"PartitionKey": _PARTITION[type(owner)], "RowKey": _row_key(type(owner), _name_of(owner)), **owner.entity()}
    row |= {"key_hash": key_hash} if key_hash else {}
    index = [Op(kind, {**row, "RowKey": f"k|{key_hash}"})] if key_hash else []
    return [Op(kind, row, etag=etag), *index]


class _Cache:
    """Answers kept per instance for ``seconds`` (from when they were asked for), by row key (a key
    index's or a team's; ``prices`` for every price), one store read at a time per key: concurrent
    first requests share it."""

    def __init__(self, seconds: float, clock: Callable[[], float]):
        self.seconds = seconds
        self.clock = clock
        self._kept: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    def known(self, key: str) -> bool:
        """Whether ``key`` is being read now, an earlier read found it (its answer may be stale), or
        an answer (even "none") is kept in its time."""
        kept = self._kept.get(key)
        return key in self._pending or (kept is not None and (kept[1] is not None or kept[0] > self.clock()))

    async def get(self, key: str, read: Callable[[], Awaitable[T]], what: str) -> T | Unavailable:
        """The answer for ``key``: the one kept in its time (at once: no task, no loop hop on the
        request's path; read ahead near its end: module docstring), else read (Unavailable, logged,
        when the store does not answer)."""
        kept = self._kept.get(key)
        if kept is not None and kept[0] > self.clock():
            self._kept.move_to_end(key)
            if key not in self._pending and kept[0] - self.clock() <= self.seconds * AHEAD:
                self._read(key, read, what, AHEAD_DELAY)
            return kept[1]
        return await asyncio.shield(self._pending.get(key) or self._read(key, read, what))

    def _read(self, key: str, read: Callable[[], Awaitable[Any]], what: str, delay: float = 0.0) -> asyncio.Future:
        async def reading() -> Any:
            if delay:
                await asyncio.sleep(delay)
            asked = self.clock()  # kept from then: a change after it takes effect within ``seconds``, exactly
            try:
                value = await read()
            except StoreError as exc:  # not kept: the next request asks again
                log.warning("caller store: %s%s failed: %s", what, " ahead" if delay else "", exc)
                return Unavailable()
            self._kept[key] = (asked + self.seconds, value)
            self._kept.move_to_end(key)
            while len(self._kept) > MAX_CACHED:
                self._evict()
            return value

        pending = self._pending[key] = asyncio.ensure_future(reading())
        pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return pending

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
        self._logged: set[tuple[str, str]] = set()  # rows (key, ETag) found unreadable: logged

    # --- the request path -----------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> Caller | KeyRefused | Unreadable | Unavailable:
        """The caller whose key this is, or why not (port.py; Unavailable also when too many unknown
        keys are asked now)."""
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

    async def _cached(self, cls: type[Kept], row_key: str, what: str) -> Kept | Unreadable | Unavailable | None:
        """The ``cls`` in row ``row_key`` (None: none), from the cache or read into it."""

        async def read() -> Kept | Unreadable | None:
            row = await self.store.get(CALLERS_TABLE, _PARTITION[cls], row_key, timeout=self.store.clock.patience())
            return self._parse(cls, row) if row is not None else None

        return await self.cache.get(row_key, read, what)

    async def terms(self, caller: Caller) -> tuple[Team | None, Prices | Unavailable] | Unreadable | Unavailable:
        """What ``caller``'s requests are admitted and charged under, cached like keys: its team (None:
        none, or gone: only a race leaves a caller without it, as a team with callers cannot be
        deleted; Unreadable: its row holds none) and every model's price (Unavailable apart: the
        team is known without them, and a team's refusal, the models it lists, come first)."""
        team = None
        if caller.team is not None:
            team = await self._cached(Team, _row_key(Team, caller.team), "team read")
            if isinstance(team, Unreadable | Unavailable):
                return team
            if team is None or team.id != caller.team_id:
                log.warning("caller %s: its team %s is gone; its team limits do not apply", caller.name, caller.team)
                team = None

        async def read() -> Prices:
            return Prices(await self.list(Price, bound=self.store.clock.patience()))

        return team, await self.cache.get(PRICES, read, "price read")

    async def caller_by_id(self, caller_id: str) -> Caller | Unavailable | None:
        """The caller with this id (None: gone), for a stream taken over (its record names its owner
        by id). A scan of the callers: rare, and bounded by the number of callers."""
        try:
            found = await self.list(Caller, {"id": caller_id}, self.store.clock.patience())
        except StoreError:
            return Unavailable()
        return next((c for c in found if isinstance(c, Caller)), None)

    # --- the admin API: one path for callers, teams and prices -------------------------------------

    async def list(
        self, cls: type[Kept], equal: dict | None = None, bound: float = ADMIN_TIMEOUT
    ) -> list[Kept | Unreadable]:
        """Every caller, team or price (with the properties ``equal``), by name (model); one whose row
        holds none as Unreadable (an admin sees it, and deletes it)."""
        partition, prefix = _PARTITION[cls], _PREFIX[cls]
        where = Where(partition=partition, rows_from=prefix, rows_to=prefix[:-1] + "}", equal=equal or {})
        rows = await self.store.query(CALLERS_TABLE, where, timeout=bound)
        return sorted((self._parse(cls, row) for row in rows), key=_name_of)

    def _parse(self, cls: type[Kept], row: Row) -> Kept | Unreadable:
        """The caller, team or price ``row`` keeps; Unreadable when it holds none, logged once per
        version of the row (not at every read)."""
        try:
            return cls.of(row)
        except (TypeError, ValueError) as exc:
            error = exc
        name = row.get("model" if cls is Price else "name")
        if not isinstance(name, str):  # (a key index's row key is no name)
            name = "" if row["RowKey"].startswith("k|") else unquote(row["RowKey"][2:])
        if (row["RowKey"], row.etag) not in self._logged:
            if len(self._logged) > 1000:
                self._logged.clear()
            self._logged.add((row["RowKey"], row.etag))
            whose = {Price: "its model's", Team: "its callers'", Caller: "its key's"}[cls]
            log.error(
                "%s row %r of table %s is unreadable (%s): %s requests are refused until it is set again or deleted",
                cls.__name__.lower(),
                log_safe(row["RowKey"])[:90],
                CALLERS_TABLE,
                error,
                whose,
            )
        found_id = row.get("id")
        return Unreadable(
            "team" if cls is Team else "caller", name, str(error), found_id if isinstance(found_id, str) else None
        )

    async def _write(self, ops: list[Op]) -> None:
        """Write ``ops`` (one transaction); what this instance kept of their rows is dropped."""
        await self.store.batch(CALLERS_TABLE, ops, timeout=ADMIN_TIMEOUT)
        for op in ops:
            self.cache.forget(PRICES if op.entity["PartitionKey"] == PRICES else op.entity["RowKey"])

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    async def _values(self, data: TeamPatch, given: Iterable[str]) -> dict[str, Any]:
        """The fields ``given`` of what an admin said as a caller's or team's values, the one reading
        of it: a caller's expiry in the future, its team one that exists (and its id)."""
        values = {f: getattr(data, f) for f in given if f != "team"}
        if isinstance(data, CallerPatch):
            if "expires_at" in given and data.expires_at is not None and data.expires_at.timestamp() <= self.clock():
                raise Invalid("expires_at: must be in the future", "expires_at")
            if "team" in given:
                values["team"], values["team_id"] = data.team, None
                if data.team is not None:
                    team = await self.store.get(CALLERS_TABLE, TEAMS, _row_key(Team, data.team), timeout=ADMIN_TIMEOUT)
                    if team is None:
                        raise Invalid(f"team: no team named {data.team!r}", "team")
                    values["team_id"] = team["id"]
        return values

    async def _load(self, cls: type[Kept], name: str) -> tuple[Kept | Unreadable, str, str]:
        """The caller, team or price ``name`` (Unreadable: its row holds none), its key hash (a
        caller's) and its row's ETag; Missing when there is none (a name that cannot be one is not
        looked up)."""
        row = None
        if model_name(name) if cls is Price else NAME_PATTERN.fullmatch(name):
            row = await self.store.get(CALLERS_TABLE, _PARTITION[cls], _row_key(cls, name), timeout=ADMIN_TIMEOUT)
        if row is None:
            raise Missing("price for model" if cls is Price else cls.__name__.lower(), log_safe(name)[:80])
        key_hash = row.get("key_hash")
        return self._parse(cls, row), key_hash if isinstance(key_hash, str) else "", row.etag

    async def _change(
        self,
        cls: type[Kept],
        name: str,
        doing: str,
        change: Callable[[Any, str, str], Awaitable[tuple[list[Op], Any]]],
        unreadable: bool = False,
    ) -> Any:
        """Read the caller, team or price ``name``, write the operations ``change`` makes of it (under
        its row's ETag), and again when another admin's change came in between, ``_TRIES`` times.
        Conflict when its row holds none (unless ``unreadable``): it can be deleted (and created
        again), not changed."""
        for _ in range(_TRIES):
            kept, key_hash, etag = await self._load(cls, name)
            if isinstance(kept, Unreadable) and not unreadable:
                what = "PUT it again" if cls is Price else "delete it and create it again"
                raise Conflict(f"the {cls.__name__.lower()}'s record in the store is unreadable ({kept.why}): {what}")
            ops, result = await change(kept, key_hash, etag)
            try:
                await self._write(ops)
            except (Modified, NotFound, AlreadyExists):
                continue  # another admin's change in between: read again and reapply
            return result
        raise Conflict(f"the {cls.__name__.lower()} changed repeatedly while {doing}; try again")

    async def create(self, data: CallerSpec | TeamSpec) -> tuple[Caller | Team, str]:
        """A new caller and its key (shown this once), or a new team (and no key: "")."""
        said = await self._values(data, type(data).model_fields)
        values = {"id": secrets.token_hex(6), "created_at": self._now(), **said}
        key = new_key() if isinstance(data, CallerSpec) else ""
        made = Caller(**values, key_hint=key[-4:]) if isinstance(data, CallerSpec) else Team(**values)
        kind = type(made).__name__.lower()
        try:
            await self._write(_ops("insert", made, hash_key(key) if key else ""))
        except AlreadyExists:
            raise Invalid(f"name: a {kind} named {made.name!r} already exists", "name") from None
        log.info("%s %s created%s", kind, made.name, f" (key …{key[-4:]})" if key else "")
        return made, key

    async def get(self, cls: type[Kept], name: str) -> Kept | Unreadable:
        """The caller, team or price (``name``: its model), as ``_load`` reads it."""
        return (await self._load(cls, name))[0]

    async def update(self, cls: type[Kept], name: str, data: CallerPatch | TeamPatch) -> Kept:
        """Change the fields ``data`` names (a caller's key stays)."""
        given = data.model_fields_set
        values = await self._values(data, given)

        async def change(owner: Kept, key_hash: str, etag: str) -> tuple[list[Op], Kept]:
            updated = replace(owner, **values)
            return _ops("replace", updated, key_hash, etag), updated

        updated = await self._change(cls, name, "being updated", change)
        log.info("%s %s updated (%s)", cls.__name__.lower(), name, ", ".join(sorted(given)) or "nothing")
        return updated

    async def delete(self, cls: type[Kept], name: str) -> Kept | Unreadable:
        """Remove the caller (and its key, which stops working on every instance within
        ``cache_seconds``), the team (only one without callers: Conflict otherwise) or the price,
        readable or not; a caller's or team's limit counters best effort (harmless if that fails: one
        created again under its name gets a new id)."""

        async def change(kept: Kept | Unreadable, key_hash: str, etag: str) -> tuple[list[Op], Kept | Unreadable]:
            # (an unreadable caller row of the team's counts too)
            if cls is Team and (members := await self.list(Caller, {"team": name})):
                raise Conflict(f"team {name!r} still has {len(members)} caller(s): move or delete them first")
            ops = [Op("delete", {"PartitionKey": _PARTITION[cls], "RowKey": _row_key(cls, name)}, etag=etag)]
            if cls is Caller:  # its key index: the one its row names, else (unreadable) any that names it
                if key_hash:
                    index = await self.store.get(CALLERS_TABLE, CALLERS, f"k|{key_hash}", timeout=ADMIN_TIMEOUT)
                    indexes = [index] if index is not None else []
                else:
                    where = Where(partition=CALLERS, rows_from="k|", rows_to="k}", equal={"name": name})
                    indexes = await self.store.query(CALLERS_TABLE, where, timeout=ADMIN_TIMEOUT)
                ops += [Op("delete", {"PartitionKey": CALLERS, "RowKey": r["RowKey"]}, etag=r.etag) for r in indexes]
            return ops, kept

        kept: Kept | Unreadable = await self._change(cls, name, "being deleted", change, unreadable=True)
        kind, name = cls.__name__.lower(), log_safe(name)[:80]
        partition = kept.limits_partition if isinstance(kept, Caller | Team) else None
        if isinstance(kept, Unreadable) and kept.id is not None:
            partition = limits_partition(kept.scope, kept.name, kept.id)
        if partition is not None:
            try:
                await counter_row.forget(self.store, partition, ADMIN_TIMEOUT)
            except StoreError as exc:
                log.warning("%s %s deleted; its limit counters were left in the store: %s", kind, name, exc)
        log.info("%s %s deleted", kind, name)
        return kept

    async def rotate(self, name: str) -> tuple[Caller, str]:
        """A new key for the caller; the old one stops working (on every instance within
        ``cache_seconds``). Limits, usage and counters stay."""
        key = new_key()

        async def change(caller: Caller, old_hash: str, etag: str) -> tuple[list[Op], Caller]:
            rotated = replace(caller, key_hint=key[-4:])
            row, index = _ops("replace", rotated, hash_key(key), etag)
            old = Op("delete", {"PartitionKey": CALLERS, "RowKey": f"k|{old_hash}"})
            return [row, old, replace(index, kind="insert")], rotated

        rotated = await self._change(Caller, name, "its key was rotated", change)
        log.info("caller %s: key rotated (now …%s)", name, rotated.key_hint)
        return rotated, key

    async def set_price(self, model: str, data: PriceSpec) -> Price:
        """The model's price, as given (a new one, or in place of the one it had)."""
        if not isinstance(model, str) or not model_name(model):
            raise Invalid("model: not a model name", "model")
        price = data.price(model, self._now())
        await self._write(_ops("upsert", price))
        log.info("price of %s set", log_safe(model)[:80])
        return price
