"""One headless Chromium tab on one of the app's pages, for their browser tests (test_playground.py,
test_console.py): Debian's Chromium through Playwright (``make chromium``), and everything the tab
requested and logged, so that a test can say nothing went elsewhere or wrong (``assert_clean``)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


@contextmanager
def chromium() -> Iterator:
    """The browser, for a module-scoped fixture; the test fails (not skips) without Chromium."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("chromium is not installed: `make chromium` installs Debian's package (make test does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Tab:
    """A browser tab of its own (a new context) on ``app``'s origin, with every request it made, its
    console errors and warnings, its script errors and its dialogs (dismissed)."""

    def __init__(self, browser, app, width: int, height: int):
        from playwright.sync_api import expect

        self.expect = expect
        self.origin = app.url
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.requests: list = []
        self.console: list[str] = []  # errors and warnings
        self.page_errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r))
        self.page.on("console", lambda m: m.type in ("error", "warning") and self.console.append(m.text))
        self.page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def assert_clean(self, expected_console: str | None = None) -> None:
        """Nothing from another origin, no script errors, no dialogs; no console error or warning but
        the browser's own note on an expected HTTP error status."""
        origin = urlsplit(self.origin)
        foreign = [r.url for r in self.requests if urlsplit(r.url)[:2] != origin[:2]]
        assert not foreign, foreign
        assert not self.page_errors, self.page_errors
        assert not self.dialogs, self.dialogs
        unexpected = [m for m in self.console if not (expected_console and re.search(expected_console, m))]
        assert not unexpected, unexpected

    def close(self) -> None:
        self.context.close()
