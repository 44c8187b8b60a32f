"""Usage for the console's tests: a ledger of many callers over many days, written into the store as
the app writes it (chatstream.state.ledger's Charge rows, through its Ledger)."""

from __future__ import annotations

import asyncio
import math
import random
from datetime import UTC, datetime, timedelta

from chatstream.state.ledger import Charge
from chatstream.state.store import USAGE_TABLE, Op
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore

TEAMS = ("search", "support", "web", "data", "mobile")
# USD per 1M tokens (input, output), as pico-dollars per token: × 10⁶.
PRICES = {"gpt-4o-mini": (0.15, 0.60), "gpt-4o": (2.50, 10.00)}


def charges(callers: int = 50, days: int = 90, seed: int = 33) -> list[Charge]:
    """One charge per caller, model and day (each caller uses one or both models), for the ``days``
    UTC days up to today: a few heavy callers, quieter weekends, a slow rise."""
    rng = random.Random(seed)
    today = datetime.now(UTC).date()
    out = []
    for c in range(callers):
        name, team = f"svc-{c:02d}", TEAMS[c % len(TEAMS)]
        size = math.exp(rng.gauss(11.5, 0.9))  # tokens a day, ~100k typical
        models = ("gpt-4o-mini", "gpt-4o") if c % 3 == 0 else (("gpt-4o-mini",) if c % 3 == 1 else ("gpt-4o",))
        for d in range(days):
            day = today - timedelta(days=days - 1 - d)
            weekend = 0.45 if day.weekday() >= 5 else 1.0
            for model in models:
                total = int(size * weekend * (0.6 + 0.8 * d / days) * rng.uniform(0.7, 1.3) / len(models))
                prompt, completion = int(total * 0.7), total - int(total * 0.7)
                price_in, price_out = PRICES[model]
                out.append(
                    Charge(
                        caller=name,
                        caller_id=f"seed{c:02d}",
                        team=team,
                        team_id=f"team-{team}",
                        model=model,
                        endpoint="chat_completions",
                        request_id=f"seed-{c:02d}-{d:03d}-{model}",
                        day=f"{day:%Y%m%d}",
                        prompt_tokens=prompt,
                        completion_tokens=completion,
                        ended="completed",
                        cost=prompt * int(price_in * 10**6) + completion * int(price_out * 10**6),
                    )
                )
    return out


async def seed_usage(connection_string: str, callers: int = 50, days: int = 90) -> int:
    """Write the charges into the ledger of the store behind ``connection_string``, as the Ledger
    does (each row Charge.entity(), transactions of 100 rows of one partition), several at a time;
    how many."""
    store = AzureStore(Account(connection_string))
    rows = charges(callers, days)
    by_partition: dict[str, list[Charge]] = {}
    for charge in rows:
        by_partition.setdefault(charge.partition, []).append(charge)
    chunks = [group[i : i + 100] for group in by_partition.values() for i in range(0, len(group), 100)]
    gate = asyncio.Semaphore(6)

    async def write(chunk: list[Charge]) -> None:
        async with gate:
            await store.batch(USAGE_TABLE, [Op("insert", c.entity()) for c in chunk], timeout=60)

    try:
        await asyncio.gather(*(write(chunk) for chunk in chunks))
    finally:
        await store.close()
    return len(rows)
