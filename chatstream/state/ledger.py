"""The usage ledger: one row per charge, and usage summed by caller, model and day (docs/callers.md).

Table ``chatstreamUsage``, one partition per caller:

- ``t|<time, UTC, to the microsecond>|<request id>``: the charge (model, endpoint, prompt and
  completion tokens, how the request ended), in time order, so that a period is one range query;
- ``r|<request id>``: the id row, written in the same transaction, so that recording a request
  twice (a retry after a lost answer, two instances seeing one background response) adds nothing.

``record`` is one bounded store call; what it raises (503 ``caller_store_unavailable``) the caller may
retry with the same ``Charge``: it is idempotent."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import quote

from azure.data.tables import EdmType, EntityProperty, TableTransactionError

from .calls import StoreDown, bounded, store_unavailable
from .legacy_store import USAGE_TABLE, Store

log = logging.getLogger("chatstream")

# How a charged request ended (the stream core's outcomes, and the refusal-free ones after it).
ENDINGS = ("completed", "disconnected", "timeout", "failed", "cancelled", "background", "incomplete")
MAX_USAGE_DAYS = 366  # the longest period one usage query may cover
USAGE_TIMEOUT = 10.0  # a usage query (admin only) may read many rows


def _key_part(text: str) -> str:
    """``text`` as part of a PartitionKey/RowKey: the characters the service refuses (``/ \\ # ?``,
    control characters) and ``|`` (our separator) percent-encoded; a long one shortened with its
    hash, so that two ids never share a key."""
    encoded = quote(text, safe="-._~:;,=+!*()[]@$&' ")
    if len(encoded) > 200:
        encoded = encoded[:150] + "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return encoded


@dataclass(frozen=True, kw_only=True)
class Charge:
    """One request's charge. ``at`` is fixed when the Charge is made: record the same object again
    to retry."""

    caller: str
    model: str
    request_id: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    ended: str  # completed, disconnected, timeout, failed, cancelled, background, incomplete...
    upstream_id: str = ""  # the upstream's x-request-id (request_id is the app's own, unique)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def _time_key(self) -> str:
        return self.at.astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def _int64(value: int) -> EntityProperty:
    return EntityProperty(int(value), EdmType.INT64)


def _int(value: Any) -> int:
    return int(value.value) if isinstance(value, EntityProperty) else int(value or 0)


class Ledger:
    def __init__(self, store: Store):
        self.store = store

    async def record(self, charge: Charge) -> bool:
        """Write the charge; False if this request id was already recorded for this caller (then
        nothing changes). Raises ApiError 503 ``caller_store_unavailable`` if the store fails."""
        if charge.prompt_tokens < 0 or charge.completion_tokens < 0:
            raise ValueError("token counts cannot be negative")
        partition = _key_part(charge.caller)
        request = _key_part(charge.request_id)
        row = f"t|{charge._time_key()}|{request}"
        entity = {
            "PartitionKey": partition,
            "RowKey": row,
            "caller": charge.caller,
            "model": charge.model,
            "request_id": charge.request_id,
            "upstream_id": charge.upstream_id,
            "endpoint": charge.endpoint,
            "prompt_tokens": _int64(charge.prompt_tokens),
            "completion_tokens": _int64(charge.completion_tokens),
            "ended": charge.ended,
            "at": charge.at.astimezone(UTC).isoformat(),
        }
        marker = {"PartitionKey": partition, "RowKey": f"r|{request}", "row": row}

        async def write() -> None:
            table = await self.store.table(USAGE_TABLE)
            await table.submit_transaction([("create", marker), ("create", entity)])

        try:
            await bounded(write())
        except TableTransactionError as exc:
            if exc.status_code == 409:
                return False
            raise
        except StoreDown as exc:
            log.warning("usage ledger: a charge was not recorded: %s", exc)
            raise store_unavailable() from None
        return True

    async def usage(
        self, caller: str | None = None, start: date | None = None, end: date | None = None
    ) -> list[dict[str, Any]]:
        """Prompt and completion tokens, and requests (with how they ended), by caller, model and UTC
        day, for the days ``start`` to ``end`` inclusive (default: the last 30 days up to today)."""
        end = end or datetime.now(UTC).date()
        start = start or end - timedelta(days=29)
        low = f"t|{start:%Y%m%d}"
        high = f"t|{end + timedelta(days=1):%Y%m%d}"
        query = "RowKey ge @lo and RowKey lt @hi"
        parameters: dict[str, Any] = {"lo": low, "hi": high}
        if caller is not None:
            query = "PartitionKey eq @p and " + query
            parameters["p"] = _key_part(caller)
        fields = ["RowKey", "caller", "model", "prompt_tokens", "completion_tokens", "ended"]

        async def read() -> dict[tuple[str, str, str], dict[str, Any]]:
            table = await self.store.table(USAGE_TABLE)
            sums: dict[tuple[str, str, str], dict[str, Any]] = {}
            async for row in table.query_entities(query, parameters=parameters, select=fields):
                day = row["RowKey"][2:10]
                key = (row.get("caller", ""), row.get("model", ""), f"{day[:4]}-{day[4:6]}-{day[6:]}")
                entry = sums.setdefault(
                    key,
                    {
                        "caller": key[0],
                        "model": key[1],
                        "day": key[2],
                        "prompt_tokens": 0,
                        "completion_tokens": 0,
                        "total_tokens": 0,
                        "requests": 0,
                        "ended": {},
                    },
                )
                prompt, completion = _int(row.get("prompt_tokens")), _int(row.get("completion_tokens"))
                entry["prompt_tokens"] += prompt
                entry["completion_tokens"] += completion
                entry["total_tokens"] += prompt + completion
                entry["requests"] += 1
                ended = row.get("ended") or "unknown"
                entry["ended"][ended] = entry["ended"].get(ended, 0) + 1
            return sums

        try:
            sums = await bounded(read(), USAGE_TIMEOUT)
        except StoreDown as exc:
            log.warning("usage ledger: a usage query failed: %s", exc)
            raise store_unavailable() from None
        return [sums[k] for k in sorted(sums)]


def totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The sums over usage rows (the admin API's ``total``)."""
    return {f: sum(int(r[f]) for r in rows) for f in ("prompt_tokens", "completion_tokens", "total_tokens", "requests")}
