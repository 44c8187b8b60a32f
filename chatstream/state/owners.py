"""What a caller creates belongs to it: a stored or background response (and a resumable stream) can
be read, resumed, cancelled or deleted only by the caller that created it (docs/callers.md).

Table ``chatstreamResponses``: PartitionKey the object's id, RowKey its kind (``response``,
``stream``), with ``caller`` and ``charged`` (a background response is charged once, when its usage
is first seen: ``first_charge`` is true for exactly one call, whichever instance makes it). One
partition per id spreads the load; every call is one or two point operations, bounded."""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime

from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import UpdateMode

from .calls import StoreDown, bounded, store_unavailable
from .ledger import _key_part
from .legacy_store import RESPONSES_TABLE, Store

log = logging.getLogger("chatstream")


class Owners:
    def __init__(self, store: Store):
        self.store = store

    async def _call(self, operation):
        try:
            return await bounded(operation)
        except StoreDown as exc:
            log.warning("owners: a store call failed: %s", exc)
            raise store_unavailable() from None

    async def claim(self, kind: str, id: str, caller: str, reserved: int = 0, at: float = 0.0) -> bool:
        """Record that ``caller`` created ``kind``/``id`` (``reserved``, ``at``: a background response's
        reservation, settled when its usage is seen: ``held``). True if it is (now or already) that
        caller's; False if another caller had claimed it (the claim is not changed)."""

        async def write() -> bool:
            table = await self.store.table(RESPONSES_TABLE)
            try:
                await table.create_entity(
                    {
                        "PartitionKey": _key_part(id),
                        "RowKey": kind,
                        "caller": caller,
                        "charged": False,
                        "reserved": reserved,
                        "reserved_at": at,
                        "created_at": datetime.now(UTC).isoformat(),
                    }
                )
                return True
            except ResourceExistsError:
                row = await table.get_entity(_key_part(id), kind)
                return row.get("caller") == caller

        return await self._call(write())

    async def owner(self, kind: str, id: str) -> str | None:
        """The caller that created ``kind``/``id``, or None if nobody claimed it. A route answers 404
        to anyone else (the object's existence is not revealed)."""

        async def read() -> str | None:
            table = await self.store.table(RESPONSES_TABLE)
            try:
                row = await table.get_entity(_key_part(id), kind, select=["caller"])
            except ResourceNotFoundError:
                return None
            return row.get("caller") or None

        return await self._call(read())

    async def first_charge(self, kind: str, id: str) -> bool:
        """True exactly once per ``kind``/``id`` across every instance: the caller that gets True
        records the charge; every later call (or a concurrent one that lost) gets False."""

        async def mark() -> bool:
            table = await self.store.table(RESPONSES_TABLE)
            key = _key_part(id)
            for _ in range(10):
                try:
                    row = await table.get_entity(key, kind)
                except ResourceNotFoundError:
                    try:  # never claimed (created before callers were on): the first mark wins
                        await table.create_entity(
                            {
                                "PartitionKey": key,
                                "RowKey": kind,
                                "caller": "",
                                "charged": True,
                                "created_at": datetime.now(UTC).isoformat(),
                            }
                        )
                        return True
                    except ResourceExistsError:
                        continue
                if row.get("charged"):
                    return False
                try:
                    await table.update_entity(
                        {"PartitionKey": key, "RowKey": kind, "charged": True},
                        mode=UpdateMode.MERGE,
                        etag=row.metadata["etag"],
                        match_condition=MatchConditions.IfNotModified,
                    )
                    return True
                except (ResourceModifiedError, ResourceNotFoundError):
                    continue
            return False

        return await self._call(mark())

    async def held(self, kind: str, id: str) -> tuple[int, float]:
        """The reservation a claim recorded: (tokens, when); (0, 0.0) when it recorded none."""

        async def read() -> tuple[int, float]:
            table = await self.store.table(RESPONSES_TABLE)
            try:
                row = await table.get_entity(_key_part(id), kind, select=["reserved", "reserved_at"])
            except ResourceNotFoundError:
                return 0, 0.0
            return int(row.get("reserved") or 0), float(row.get("reserved_at") or 0.0)

        return await self._call(read())

    async def forget(self, kind: str, id: str) -> None:
        """Drop the record (the object was deleted)."""

        async def delete() -> None:
            table = await self.store.table(RESPONSES_TABLE)
            with contextlib.suppress(ResourceNotFoundError):
                await table.delete_entity(_key_part(id), kind)

        await self._call(delete())
