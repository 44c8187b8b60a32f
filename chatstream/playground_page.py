"""The browser playground: GET /api/playground serves one page (the files in chatstream/playground/)
that talks to this app's own OpenAI-compatible API with relative URLs. Here: whether it is served at
all (decided once at start-up), which files exist (read once; ``FILES`` is a fixed table, so any
other name is a 404 without touching the file system, and ``/api/playground/`` redirects with a 308),
and the headers they go out with (``HEADERS``). docs/playground.md.

The page (playground.js) reads the stream with ``fetch()`` and an ``AbortController``, a
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

from fastapi.responses import Response

from .http import with_request_id
from .settings import Settings

FOLDER = Path(__file__).parent / "playground"

# The only files there are: route parameter → (file name, content type). Anything else is a 404, so
# nothing a request sends ever reaches the file system as a path.
FILES: dict[str | None, tuple[str, str]] = {
    None: ("index.html", "text/html; charset=utf-8"),
    "playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "playground.css": ("playground.css", "text/css; charset=utf-8"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}

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
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def running_in_azure(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(name) for name in AZURE_MARKERS)


def enabled(settings: Settings, environ: Mapping[str, str] = os.environ) -> bool:
    """PLAYGROUND_ENABLED when set; otherwise on locally and off in Azure."""
    if settings.playground_enabled is not None:
        return settings.playground_enabled
    return not running_in_azure(environ)


class Playground:
    """Answers GET /api/playground and /api/playground/{file}: the page when enabled, else 404."""

    def __init__(self, on: bool, folder: Path = FOLDER):
        self.enabled = on
        # Read once, at start-up: a missing file stops the app here rather than failing a request.
        self._bodies = {key: (folder / name).read_bytes() for key, (name, _) in FILES.items()} if on else {}

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] = os.environ) -> Playground:
        return cls(enabled(settings, environ))

    def __call__(self, file: str | None, path: str) -> Response:
        """``file``: the route parameter (None for the page itself); ``path``: the request's path."""
        return with_request_id(self._answer(file, path))

    def _answer(self, file: str | None, path: str) -> Response:
        if not self.enabled or file not in FILES:
            return Response(status_code=404, headers={"Cache-Control": "no-store"})
        if file is None and path.endswith("/"):
            # The page's relative URLs (playground/…, v1/…) resolve from /api/playground only.
            return Response(status_code=308, headers={"Location": "../playground", "Cache-Control": "no-store"})
        return Response(self._bodies[file], media_type=FILES[file][1], headers=HEADERS)
