"""Which browser callers the local host serves (like ``func start --cors``).

A web page can make a browser send a form-encoded POST anywhere without a CORS preflight, and the
app reads such a body as JSON (so that ``curl -d '{...}'`` works). Without this check any page a
developer opens could start completions through their local host and their key. Browsers name the
page's origin in ``Origin`` (on every cross-origin request and on every POST) and say how the
request relates to the page in ``Sec-Fetch-Site``. The rule:

- no ``Origin``: served, unless ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` (another
  site, or another port of this machine) and not every origin is allowed. curl and SDKs send
  neither header;
- ``Origin`` is the host itself (``http://127.0.0.1:PORT`` or ``http://localhost:PORT``, PORT the
  port it listens on, so that a page it serves may call it): served as is;
- ``Origin`` is allowed by the setting (``--cors``, ``CORS_ALLOWED_ORIGINS``, or ``Host.CORS`` in
  local.settings.json; comma-separated, ``*`` for any): served with CORS response headers, and its
  preflights (``OPTIONS`` with ``Access-Control-Request-Method``) answered 204;
- anything else (``Origin: null`` included): 403 with a JSON error, before the function runs.

A DNS-rebinding page (another name resolving to 127.0.0.1) is caught by the same rule: its Origin
carries its own name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
PREFLIGHT_MAX_AGE = b"600"


def canonical_origin(text: str) -> str | None:
    """``scheme://host:port`` in lower case with the port spelled out, or None if ``text`` is not a
    serialized http(s) origin (no path, query, fragment or user info)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if (
        scheme not in DEFAULT_PORTS
        or not parts.hostname
        or parts.username is not None
        or parts.password is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port or DEFAULT_PORTS[scheme]}"


@dataclass(frozen=True)
class CorsPolicy:
    origins: frozenset[str] = frozenset()  # canonical origins allowed besides the host's own
    any_origin: bool = False

    @classmethod
    def parse(cls, setting: str, name: str) -> CorsPolicy:
        """From a comma-separated list; raises ValueError naming ``name`` and the bad entry."""
        origins, any_origin = set(), False
        for item in (part.strip() for part in setting.split(",")):
            if not item:
                continue
            if item == "*":
                any_origin = True
                continue
            origin = canonical_origin(item)
            if origin is None:
                raise ValueError(f"{name}: {item!r} is not an origin (scheme://host[:port], or *)")
            origins.add(origin)
        return cls(frozenset(origins), any_origin)

    def describe(self) -> str:
        return "any origin" if self.any_origin else ", ".join(sorted(self.origins)) or "none"


# Outcomes of decide()
SERVE = "serve"  # no browser origin to answer to, or the host's own: no CORS headers
SERVE_CORS = "serve_cors"  # an allowed other origin: CORS headers on the answer
REFUSE = "refuse"


def decide(policy: CorsPolicy, headers: list[tuple[bytes, bytes]], port: int | None) -> tuple[str, str | None]:
    """(outcome, the request's Origin) for a request's headers, ``port`` the one the host listens on."""
    origin = fetch_site = None
    for name, value in headers:
        name = name.lower()
        if name == b"origin" and origin is None:
            origin = value.decode("latin-1").strip()
        elif name == b"sec-fetch-site" and fetch_site is None:
            fetch_site = value.decode("latin-1").strip().lower()
    if origin is None:
        if fetch_site in ("cross-site", "same-site") and not policy.any_origin:
            return REFUSE, None
        return SERVE, None
    canonical = canonical_origin(origin)
    if (
        canonical is not None
        and port is not None
        and canonical in (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    ):
        return SERVE, origin
    if policy.any_origin or canonical in policy.origins:
        return SERVE_CORS, origin
    return REFUSE, origin


def response_headers(policy: CorsPolicy, origin: str) -> list[tuple[bytes, bytes]]:
    """Added to every answer to an allowed cross-origin request."""
    if policy.any_origin:
        return [(b"access-control-allow-origin", b"*"), (b"access-control-expose-headers", b"*")]
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", b"*"),
    ]


def preflight_headers(policy: CorsPolicy, origin: str, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The answer to an allowed preflight: the method and headers it asks for, cached 10 minutes."""
    asked = {k.lower(): v for k, v in headers}
    out = [
        (b"access-control-allow-origin", b"*" if policy.any_origin else origin.encode("latin-1")),
        (b"access-control-allow-methods", asked.get(b"access-control-request-method", b"POST")),
        (b"access-control-max-age", PREFLIGHT_MAX_AGE),
        (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
    ]
    if asked.get(b"access-control-request-headers"):
        out.append((b"access-control-allow-headers", asked[b"access-control-request-headers"]))
    return out


def refusal_body(origin: str | None) -> bytes:
    who = f"origin {origin!r}" if origin is not None else "a page of another site"
    return json.dumps(
        {
            "error": {
                "type": "cross_origin_forbidden",
                "message": f"The local host refuses requests from {who}. To allow a browser origin, start it "
                f"with --cors ORIGIN or set CORS_ALLOWED_ORIGINS (comma-separated, * for any).",
            }
        }
    ).encode()
