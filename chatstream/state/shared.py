"""The app's shared state, built once at start-up from the settings: the store (AzureWebJobsStorage),
the callers' registry, their limits, the usage ledger and who owns what; ``accounting`` when
``CALLER_KEYS=required``. Without a storage setting there is none, and the features that need it are
refused at start-up with a message naming the setting."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from .. import tokens
from ..settings import Settings, SettingsError
from .accounting import Accounting
from .ledger import Ledger
from .legacy_store import Store, StoreConfigError, store_from_env
from .owners import Owners
from .quota import Quota
from .registry import CallerRegistry

log = logging.getLogger("chatstream")
# azure-core logs every storage request and response at INFO: a line per counter exchange is noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)


@dataclass
class SharedState:
    store: Store
    registry: CallerRegistry
    quota: Quota
    ledger: Ledger
    owners: Owners
    accounting: Accounting | None  # CALLER_KEYS=required

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] = os.environ) -> SharedState | None:
        try:
            store = store_from_env(environ)
        except StoreConfigError as exc:
            raise SettingsError(f"invalid app settings: {exc}") from None
        if store is None:
            for needs, on in (
                ("CALLER_KEYS=required", settings.caller_keys == "required"),
                ("RESUMABLE_STREAMS=on", settings.resumable_streams),
            ):
                if on:
                    raise SettingsError(
                        f"invalid app settings: {needs} needs the app's storage: set "
                        "AzureWebJobsStorage (locally, make serve starts Azurite for it)"
                    )
            return None
        log.info("shared state: %s", store.config.describe())
        registry = CallerRegistry(store, settings.caller_cache_seconds)
        # One id per process: the leases of limits are this instance's.
        quota = Quota(store, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        ledger, owners = Ledger(store), Owners(store)
        accounting = None
        if settings.caller_keys == "required":
            accounting = Accounting(registry, quota, ledger, owners, settings.default_max_output_tokens)
            # The tokenizer's tables take about a second to build: off the first request's path.
            threading.Thread(target=tokens.preload, name="tokenizer-preload", daemon=True).start()
        return cls(store, registry, quota, ledger, owners, accounting)

    async def close(self) -> None:
        await self.store.close()
