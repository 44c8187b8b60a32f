"""The app's store from its settings: the one module that imports a backend (store.py imports none,
so nothing imports in a circle), and only when a store is configured."""

from __future__ import annotations

import time
from collections.abc import Mapping

from .store import StorageConfig, Store, StoreClock


def store_from_env(environ: Mapping[str, str]) -> Store | None:
    """The app's store from its settings (None when none is set)."""
    config = StorageConfig.from_env(environ)
    if config is None:
        return None
    from .store_azure import AzureStore  # the storage SDKs load only when a store is configured

    # Tests only: this instance's own clock runs this many seconds off (the store's clock must rule).
    offset = float(environ.get("CHATSTREAM_TEST_CLOCK_OFFSET_SECONDS") or 0.0)
    return AzureStore(config, StoreClock(wall=lambda: time.time() + offset) if offset else None)
