"""The app's two browser pages, each one page of files in its folder that talks to the app with
relative URLs: the playground, GET /api/playground (chatstream/playground/: a chat page on the app's
own OpenAI-compatible API, docs/playground.md), and the operators' console, GET /api/console
(chatstream/console/: teams, callers and their keys, prices, usage, on the admin API of manage.py,
docs/console.md). Here: whether a page is served at all (decided once at start-up), which files
exist (read once; a fixed table, so any other name is a 404 without touching the file system, and
``/api/playground/`` redirects with a 308), and the headers they go out with (``HEADERS``).

The playground (playground.js) reads the stream with ``fetch()`` and an ``AbortController``, a
``TextDecoder`` with ``{stream: true}`` (a UTF-8 character split across reads is completed by the
next) and a small SSE parser (``SseParser``: CRLF, CR or LF line ends, also split across reads;
comments skipped; ``data:`` lines joined; an unterminated last event dropped; each event counted by
its own ``id:`` line). Only choice 0's ``delta.content`` is shown, and only as DOM text nodes: the
script has no ``innerHTML`` or other HTML sink (a test checks its source), and the CSP forbids
inline handlers anyway."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from fastapi.responses import Response

from .http import NO_STORE, with_request_id
from .settings import Settings

Name = Literal["playground", "console"]

# Azure sets these on every Functions / App Service instance; `func start` and tools/devhost don't.
AZURE_MARKERS = ("WEBSITE_INSTANCE_ID", "WEBSITE_SITE_NAME")

# Own-origin files only: no inline script or style, no other origin, not framed, no forms posted.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    **NO_STORE,
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def enabled(name: Name, settings: Settings, environ: Mapping[str, str] = os.environ) -> bool:
    """PLAYGROUND_ENABLED (CONSOLE_ENABLED) when set; otherwise on locally and off in Azure."""
    setting = settings.playground_enabled if name == "playground" else settings.console_enabled
    return setting if setting is not None else not any(environ.get(marker) for marker in AZURE_MARKERS)


class Page:
    """Answers GET /api/{name} and /api/{name}/{file}: the page when enabled, else 404. A page holds
    no data: every call it makes goes to the app's API (the console's to the admin API, which needs
    the master key in Azure)."""

    def __init__(self, name: Name, settings: Settings):
        self.name = name
        self.enabled = enabled(name, settings)
        # The only files there are: route parameter → (file name, content type). Anything else is a
        # 404, so nothing a request sends ever reaches the file system as a path.
        self.files: dict[str | None, tuple[str, str]] = {
            None: ("index.html", "text/html; charset=utf-8"),
            f"{name}.js": (f"{name}.js", "text/javascript; charset=utf-8"),
            f"{name}.css": (f"{name}.css", "text/css; charset=utf-8"),
            "favicon.svg": ("favicon.svg", "image/svg+xml"),
        }
        folder = Path(__file__).parent / name
        # Read once, at start-up: a missing file stops the app here rather than failing a request.
        self._bodies = (
            {key: (folder / file).read_bytes() for key, (file, _) in self.files.items()} if self.enabled else {}
        )

    def __call__(self, file: str | None, path: str) -> Response:
        """``file``: the route parameter (None for the page itself); ``path``: the request's path."""
        if not self.enabled or file not in self.files:
            response = Response(status_code=404, headers=NO_STORE)
        elif file is None and path.endswith("/"):
            # The page's relative URLs (playground/…, v1/…; console/…, manage/…) resolve from /api/{name} only.
            response = Response(status_code=308, headers={"Location": f"../{self.name}", **NO_STORE})
        else:
            response = Response(self._bodies[file], media_type=self.files[file][1], headers=HEADERS)
        return with_request_id(response)
