"""state/journal.py's Recovery on a real Azurite: two instances recover the same dead one at the same time."""

from __future__ import annotations

import asyncio
import json
import secrets

from unit.state_helpers import admit, finish, settings, usage

from chatstream import tokens
from chatstream.state.accounting import Admission
from chatstream.state.callers import CallerSpec, TeamSpec
from chatstream.state.counter_row import parse_holds
from chatstream.state.journal import Recovery, journal_name
from chatstream.state.prices import PriceSpec
from chatstream.state.shared import SharedState
from chatstream.state.store import LIMITS_TABLE, USAGE_TABLE, Where
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore

MODEL = "gpt-4o"
BUDGETS = {"token_budget": 1_000_000, "spend_budget": 10, "budget_period": "month"}
GENERATED = "The quick brown fox jumps over the lazy dog, and then it runs off into the woods again."


def test_two_instances_recovering_the_same_dead_one_at_once_charge_everything_once(azurite):
    """a settles one request and dies with two open (their checkpoints in its journal); b and c
    recover a at the same time: each request is in the ledger once (the open ones ``lost`` at their
    checkpoint), each budget row of the caller and its team holds exactly the ledger and nothing
    else (but a later version's holds item and column, kept), and a's journal is gone."""

    async def run() -> None:
        run_id = secrets.token_hex(3)
        names = [f"{who}-{run_id}" for who in "abc"]
        a, b, c = (SharedState.on(AzureStore(Account(azurite.connection_string)), settings(), None, n) for n in names)
        try:
            a.journal.interval = 0.05
            acc = a.accounting
            assert acc is not None
            await a.registry.set_price(MODEL, PriceSpec(input=1, output=2))
            team, _ = await a.registry.create(TeamSpec.model_validate({"name": f"t{run_id}", **BUDGETS}))
            caller, _ = await a.registry.create(
                CallerSpec.model_validate({"name": f"c{run_id}", "team": f"t{run_id}", **BUDGETS})
            )
            done, rec = await admit(acc, caller, "one")
            assert isinstance(done, Admission)
            finish(acc, done, rec, usage(100, 50))
            assert await acc.flush(10)
            opened = [await admit(acc, caller, text) for text in ("two", "three")]
            for admission, _ in opened:
                assert isinstance(admission, Admission)
                admission.entry.generated = lambda: {0: GENERATED}
            for _ in range(100):  # the journal lists both with their checkpoints
                found = await a.store.get_blob(journal_name(names[0]))
                entries = json.loads(found[0])["entries"] if found else []
                if sum(1 for e in entries if e.get("generated")) == 2:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a's journal does not list its open requests")
            for part in (a.counters, a.journal):  # a stops where it is: the requests stay open
                await part.close()
            # A later version's holds item and column in one row (counter_row.py): the recovery keeps them.
            found = await a.store.get(LIMITS_TABLE, caller.limits_partition, "tokens")
            assert found is not None
            later = {**found, "holds": f"{found['holds']} op:x=1/2/3/4/5", "later": "kept", "count": 7}
            await a.store.replace(LIMITS_TABLE, later, etag=found.etag)

            await asyncio.gather(
                Recovery(b.store, b.ledger).recover(names[0], names[1]),
                Recovery(c.store, c.ledger).recover(names[0], names[2]),
            )

            rows = [r for r in await b.store.query(USAGE_TABLE, Where()) if r.get("caller_id") == caller.id]
            assert sorted(r["request_id"] for r in rows) == sorted([rec.id] + [r.id for _, r in opened])
            generated = tokens.count_text(MODEL, GENERATED)
            lost = [r for r in rows if r["ended"] == "lost"]
            assert len(lost) == 2 and all(r["completion_tokens"] == generated for r in lost)
            spent = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
            cost = sum(r["cost"] for r in rows)
            for partition in (caller.limits_partition, team.limits_partition):
                for row, amount in (("tokens", spent), ("spend", cost)):
                    counter = await b.store.get(LIMITS_TABLE, partition, row)
                    assert counter is not None and counter["taken"] == amount, (partition, row, counter)
                    assert not parse_holds(counter.get("holds")), counter
            counter = await b.store.get(LIMITS_TABLE, caller.limits_partition, "tokens")
            assert counter is not None and counter["holds"] == "op:x=1/2/3/4/5", counter
            assert (counter["later"], counter["count"]) == ("kept", 7), counter
            assert await b.store.get_blob(journal_name(names[0])) is None
        finally:
            await a.instances.close(leave=False)
            for state in (b, c):
                await state.close()
            await a.store.close()

    asyncio.run(run())
