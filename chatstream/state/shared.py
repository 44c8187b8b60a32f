"""The app's shared state, built once at start-up from the settings: the store (AzureWebJobsStorage),
this instance among the others (and the recovery of those found dead), the registry (callers, teams,
prices), the usage ledger, the journal and the counters of their limits, who owns what;
``accounting`` when ``CALLER_KEYS=required``.
Without a storage setting there is none, and the features that need it are refused at start-up with
a message naming the setting."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..settings import Settings, SettingsError
from .accounting import Accounting
from .counters import Counters
from .instances import Instances, InstanceTiming, Sweep
from .journal import Journal, Recovery, Told
from .ledger import Ledger
from .owners import Owners
from .registry import Registry
from .store import Store, StoreClock
from .store_account import Account
from .streamlog import log as streamlog
from .streamlog.config import ResumeConfig

log = logging.getLogger("chatstream")

SWEEP_SECONDS = 300.0  # the duty's sweeps of old owner rows and, with a retention, old charges


@dataclass
class SharedState:
    store: Store
    instances: Instances
    registry: Registry
    counters: Counters
    journal: Journal
    ledger: Ledger
    accounting: Accounting | None  # CALLER_KEYS=required
    resume: ResumeConfig | None  # RESUMABLE_STREAMS=on: the stream log's settings, and its sweep's

    @classmethod
    def from_settings(
        cls, settings: Settings, environ: Mapping[str, str] = os.environ, told: Told | None = None
    ) -> SharedState | None:
        """``told``: how the API layer reads a resumable stream's stored events (journal.Recovery)."""
        account = Account.from_env(environ)
        if account is None:
            needs = "CALLER_KEYS=required" if settings.caller_keys == "required" else "RESUMABLE_STREAMS=on"
            if settings.caller_keys == "required" or settings.resumable_streams:
                raise SettingsError(
                    f"invalid app settings: {needs} needs the app's storage: set "
                    "AzureWebJobsStorage (locally, make serve starts Azurite for it)"
                )
            return None
        from .store_azure import AzureStore  # the storage SDKs load only when a store is configured

        # Tests only: this instance's own clock runs this many seconds off (the store's clock must rule).
        offset = float(environ.get("CHATSTREAM_TEST_CLOCK_OFFSET_SECONDS") or 0.0)
        store = AzureStore(account, StoreClock(wall=lambda: time.time() + offset) if offset else None)
        log.info("shared state: %s", store.account.describe())
        return cls.on(store, settings, told=told)

    @classmethod
    def on(
        cls,
        store: Store,
        settings: Settings,
        timing: InstanceTiming | None = None,
        instance_id: str | None = None,
        told: Told | None = None,
    ) -> SharedState:
        """The shared state on ``store`` (one per instance; tests make several on one store, and
        name them)."""
        registry = Registry(store, settings.caller_cache_seconds)
        ledger, owners = Ledger(store), Owners(store)
        sweeps: list[Sweep] = [
            (SWEEP_SECONDS, functools.partial(sweep, store, owners, ledger, settings.ledger_retention_days))
        ]
        resume = ResumeConfig.from_settings(settings) if settings.resumable_streams else None
        if resume is not None:
            sweeps.append((resume.sweep_seconds, functools.partial(streamlog.sweep, store, resume)))
        recovery = Recovery(store, ledger, told if resume is not None else None)
        instances = Instances(store, timing, instance_id, recover=recovery.recover, sweeps=sweeps)
        journal = Journal(store, ledger, instances)
        counters = Counters(store, instances, journal)
        accounting = None
        if settings.caller_keys == "required":
            accounting = Accounting(
                registry, counters, journal, ledger, owners, settings.referenced_context_tokens, instances
            )
        return cls(store, instances, registry, counters, journal, ledger, accounting, resume)

    async def close(self) -> None:
        """A graceful stop: what this instance holds is settled and written, then everything closes."""
        settled = await self.accounting.flush(within=10.0) if self.accounting is not None else True
        await self.counters.close()
        await self.journal.close()
        # What could not be settled in time stays in the journal, for another instance to take over.
        await self.instances.close(leave=settled and not self.journal.entries)
        await self.store.close()


async def sweep(store: Store, owners: Owners, ledger: Ledger, retention_days: int) -> None:
    """The duty's sweep: old owner rows, and with a retention, old charges."""
    now = store.clock.now()
    await owners.sweep(now)
    if retention_days:
        deleted = await ledger.sweep(retention_days, now)
        if deleted:
            log.info("usage ledger: %d charges older than %d days deleted", deleted, retention_days)
