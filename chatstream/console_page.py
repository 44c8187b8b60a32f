"""The operators' console: GET /api/console serves one page (the files in chatstream/console/) that
drives this app's admin API (/api/manage/*, manage.py) with relative URLs: teams, callers and their
keys, prices, usage. Here: whether it is served at all, which files exist, and the headers they go
out with (the playground's: playground_page.py). docs/console.md."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fastapi.responses import Response

from .http import with_request_id
from .playground_page import HEADERS, running_in_azure
from .settings import Settings

FOLDER = Path(__file__).parent / "console"

# The only files there are: route parameter → (file name, content type). Anything else is a 404, so
# nothing a request sends ever reaches the file system as a path.
FILES: dict[str | None, tuple[str, str]] = {
    None: ("index.html", "text/html; charset=utf-8"),
    "console.js": ("console.js", "text/javascript; charset=utf-8"),
    "console.css": ("console.css", "text/css; charset=utf-8"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}


def enabled(settings: Settings, environ: Mapping[str, str] = os.environ) -> bool:
    """CONSOLE_ENABLED when set; otherwise on locally and off in Azure."""
    if settings.console_enabled is not None:
        return settings.console_enabled
    return not running_in_azure(environ)


class Console:
    """Answers GET /api/console and /api/console/{file}: the page when enabled, else 404. The page
    holds no data; every call it makes goes to the admin API, which needs the master key in Azure."""

    def __init__(self, on: bool, folder: Path = FOLDER):
        self.enabled = on
        # Read once, at start-up: a missing file stops the app here rather than failing a request.
        self._bodies = {key: (folder / name).read_bytes() for key, (name, _) in FILES.items()} if on else {}

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] = os.environ) -> Console:
        return cls(enabled(settings, environ))

    def __call__(self, file: str | None, path: str) -> Response:
        """``file``: the route parameter (None for the page itself); ``path``: the request's path."""
        return with_request_id(self._answer(file, path))

    def _answer(self, file: str | None, path: str) -> Response:
        if not self.enabled or file not in FILES:
            return Response(status_code=404, headers={"Cache-Control": "no-store"})
        if file is None and path.endswith("/"):
            # The page's relative URLs (console/…, manage/…) resolve from /api/console only.
            return Response(status_code=308, headers={"Location": "../console", "Cache-Control": "no-store"})
        return Response(self._bodies[file], media_type=FILES[file][1], headers=HEADERS)
