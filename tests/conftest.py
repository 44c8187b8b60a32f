"""Session servers: the scripted upstream and the app on the local host, both real processes."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import idle_clock  # noqa: F401 - before anything imports chatstream (tests/idle_clock.py)
import pytest
from cut_proxy import CutProxy
from helpers import app_env
from hypothesis import settings
from servers import App, Azurite, Upstream

# CI replays the same examples every run (a landing must not depend on the draw); locally each run
# explores new ones.
settings.register_profile("ci", derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="session")
def upstream():
    server = Upstream()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def app(upstream):
    server = App(app_env(upstream))
    yield server
    server.stop()


@pytest.fixture
def start_app(upstream):
    """Start another app instance with settings of the test's own; stopped after the test."""
    started: list[App] = []

    def start(**overrides: str) -> App:
        server = App(app_env(upstream, **overrides))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def resumable(upstream, azurite):
    """An app with RESUMABLE_STREAMS=on, on this process's Azurite (the clients' resumable tests)."""
    server = App(app_env(upstream, AzureWebJobsStorage=azurite.connection_string, RESUMABLE_STREAMS="on"))
    yield server
    server.stop()


@pytest.fixture
def cut(resumable):
    """A proxy in front of the resumable app (tests/cut_proxy.py) that drops chosen connections."""
    proxy = CutProxy(urlsplit(resumable.url).port)
    yield proxy
    proxy.close()


@pytest.fixture(scope="session")
def azurite():
    """A real Azurite for this test process (each xdist worker starts its own, in memory)."""
    server = Azurite()
    yield server
    server.stop()
