"""What a caller creates belongs to it: a stored or background response can be read, cancelled,
deleted, or continued (``previous_response_id``) only by the caller that created it
(docs/callers.md; a resumable stream's owner is in its own record: streamlog/).

Table ``chatstreamResponses``: PartitionKey the object's id, RowKey its kind (``response``), the
columns of ``Owned`` (by the caller's id: a caller deleted and created again under its name owns
nothing of the old one's), ``created`` and ``expires`` (the duty deletes the row then: the object's
own lifetime). A response is charged once: by the request that created it, or, a background
response, when its usage is first seen (``first_charge``), at the price it was admitted at. One
partition per id spreads the load; every call is one or two point operations, bounded."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Mapping
from typing import Any, Self

from pydantic.dataclasses import dataclass

from ..errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from .callers import Caller
from .prices import Price
from .store import RESPONSES_TABLE, Store, Where, key_part
from .stored import Stored

# How long an owner row is kept: OpenAI keeps a stored response 30 days.
RESPONSE_LIFETIME = 30 * 86400.0


@dataclass(frozen=True)
class Owned(Stored):
    """An owner row: who created the object, and what a background response reserved."""

    caller_id: str  # (a row written before ids names its caller: ``name:<its name>``)
    context: int = 0  # tokens a continuation of it carries (0: not known; ``set_context``)
    reserved: int = 0  # a background response: the tokens it reserved...
    reserved_spend: int = 0  # ...the money (pico-USD)...
    reserved_at: float = 0.0  # ...and when
    price: Price | None = None  # ...at the price it was admitted at (None: unpriced, or rows before it)
    charged: bool = False  # by the request that created it: ``first_charge`` is never true for it

    def by(self, caller: Caller) -> bool:
        """Whether ``caller`` created it."""
        return self.caller_id in (caller.id, f"name:{caller.name}")

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Self:
        """The row as written; ValueError when it names no owner (a charge mark without an owner)."""
        owner = row.get("caller_id") or (f"name:{row['caller']}" if row.get("caller") else None)
        price = Price.of(json.loads(row["price"])) if row.get("price") else None
        return super().of({**row, "caller_id": owner, "price": price})


class Owners:
    def __init__(self, store: Store):
        self.store = store

    def _new_row(self, kind: str, id: str, **values: Any) -> dict[str, Any]:
        now = self.store.clock.now()
        return {
            "PartitionKey": key_part(id),
            "RowKey": kind,
            **values,
            "created": now,
            "expires": now + RESPONSE_LIFETIME,
        }

    async def own(self, kind: str, id: str, owned: Owned) -> None:
        """Record that ``owned.caller_id`` created ``kind``/``id``; an owner recorded already stands,
        unchanged. StoreError when the store does not answer."""
        with contextlib.suppress(AlreadyExists):
            await self.store.insert(RESPONSES_TABLE, self._new_row(kind, id, **owned.entity()))

    async def owned(self, kind: str, id: str) -> Owned | None:
        """Who created ``kind``/``id`` (None: nobody owns it). A route answers 404 to anyone else
        (the object's existence is not revealed)."""
        row = await self.store.get(RESPONSES_TABLE, key_part(id), kind)
        return Owned.of(row) if row is not None and (row.get("caller_id") or row.get("caller")) else None

    async def set_context(self, kind: str, id: str, tokens: int) -> None:
        """A finished response's size (input + output tokens): what continuing it will carry."""
        with contextlib.suppress(NotFound):
            await self.store.merge(RESPONSES_TABLE, {"PartitionKey": key_part(id), "RowKey": kind, "context": tokens})

    async def first_charge(self, kind: str, id: str) -> bool:
        """True exactly once per ``kind``/``id`` across every instance: the caller that gets True
        records the charge; every later call (or a concurrent one that lost) gets False. The mark
        carries a token of this call's, so that a mark whose answer was lost is known for ours."""
        key = key_part(id)
        mark = secrets.token_hex(8)
        for _ in range(10):
            row = await self.store.get(RESPONSES_TABLE, key, kind)
            if row is None:
                entity = self._new_row(kind, id, charged=True, charged_by=mark)
                try:  # never owned (its ``own`` failed) or deleted meanwhile: the first mark wins
                    await self.store.insert(RESPONSES_TABLE, entity)
                    return True
                except (AlreadyExists, StoreUnavailable):
                    continue  # landed or not: the row says
            if row.get("charged"):
                return row.get("charged_by") == mark  # ours, if a mark of ours landed with its answer lost
            try:
                await self.store.merge(
                    RESPONSES_TABLE,
                    {"PartitionKey": key, "RowKey": kind, "charged": True, "charged_by": mark},
                    etag=row.etag,
                )
                return True
            except (Modified, NotFound, StoreUnavailable):
                continue
        return False

    async def forget(self, kind: str, id: str) -> None:
        """Drop the record (the object was deleted)."""
        await self.store.delete(RESPONSES_TABLE, key_part(id), kind)

    async def sweep(self, now: float, limit: int = 1000) -> int:
        """Delete the rows past their lifetime (the duty's sweep); the number deleted."""
        old = await self.store.query(
            RESPONSES_TABLE, Where(less={"expires": now}, select=(), limit=limit), timeout=20.0
        )
        deleted = 0
        for row in old:
            with contextlib.suppress(StoreError):
                await self.store.delete(RESPONSES_TABLE, row["PartitionKey"], row["RowKey"], etag=row.etag)
                deleted += 1
        return deleted
