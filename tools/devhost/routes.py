"""HTTP routes of the indexed functions: route templates from the function metadata, matched like
the Functions host (case-insensitive literals, ``{name}``, ``{name?}``, ``{*rest}``, constraints
such as ``{id:int}`` accepted and ignored).

When several routes match a path, the most specific wins, as in ASP.NET routing (which the Functions
host uses), whatever order the functions were declared in: segment by segment from the left, a
literal beats a parameter and a parameter beats a catch-all; a shorter template beats a longer one
that differs only by trailing optional segments; equal ones are ordered by template text. So a
catch-all ``v1/{*rest}`` never hides ``v1/models``, declared before or after it. A route that matches
the path but not the method is skipped (the next one may take the request); 405 only when none does."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

log = logging.getLogger("devhost")
# The Functions host keeps these route prefixes for its own APIs (its admin API, extension webhooks)
# and puts any function whose route starts with one "in error", whatever the routePrefix
# (azure-functions-host ScriptHost's route validation; issues #1781, #7634): so does this host.
RESERVED_PREFIXES = ("admin", "runtime")

_PARAM = re.compile(r"^\{(\*)?([A-Za-z_][A-Za-z0-9_]*)(?::[^}?]*)?(\?)?\}$")


@dataclass(frozen=True)
class Route:
    function_id: str
    name: str
    trigger_param: str
    methods: frozenset[str]  # empty: any method
    template: str
    pattern: re.Pattern = field(compare=False, repr=False)
    precedence: tuple = field(default=(), compare=False, repr=False)  # lower: tried first

    def allows(self, method: str) -> bool:
        return not self.methods or method.upper() in self.methods


# Segment ranks, as in ASP.NET's inbound route precedence (its ranks 2 and 4, constrained
# parameters, are not separate here: constraints are not checked).
LITERAL, PARAMETER, CATCH_ALL = 1, 3, 5


def _segments(prefix: str, template: str) -> list[str]:
    return [p for p in (prefix.strip("/") + "/" + template.strip("/")).split("/") if p]


def _precedence(prefix: str, template: str) -> tuple:
    ranks = []
    for part in _segments(prefix, template):
        m = _PARAM.match(part)
        ranks.append(LITERAL if not m else CATCH_ALL if m.group(1) else PARAMETER)
    return tuple(ranks), template.strip("/").lower()


def _compile(prefix: str, template: str) -> re.Pattern:
    parts = _segments(prefix, template)
    regex = ""
    for part in parts:
        m = _PARAM.match(part)
        if not m:
            regex += "/" + re.escape(part)
        elif m.group(1):  # catch-all
            regex += f"(?:/(?P<{m.group(2)}>.*))?"
        elif m.group(3):  # optional
            regex += f"(?:/(?P<{m.group(2)}>[^/]+))?"
        else:
            regex += f"/(?P<{m.group(2)}>[^/]+)"
    # DOTALL: a catch-all takes any character, a line feed (%0A in the URL) too, as in ASP.NET routing.
    return re.compile((regex or "/") + "/?", re.IGNORECASE | re.DOTALL)


def routes_from_metadata(metadata, prefix: str) -> list[Route]:
    """One Route per function whose trigger is an httpTrigger."""
    routes = []
    for fn in metadata:
        for raw in fn.raw_bindings:
            binding = json.loads(raw)
            if binding.get("type") != "httpTrigger":
                continue
            template = binding.get("route") or fn.name
            if template.strip("/").lower().startswith(RESERVED_PREFIXES):
                log.error(
                    "The following 1 functions are in error: %s: The specified route conflicts with one or "
                    "more built in routes.",
                    fn.name,
                )
                continue
            methods = frozenset(m.upper() for m in binding.get("methods") or ())
            routes.append(
                Route(
                    fn.function_id,
                    fn.name,
                    binding["name"],
                    methods,
                    template,
                    _compile(prefix, template),
                    _precedence(prefix, template),
                )
            )
    return sorted(routes, key=lambda r: r.precedence)


def match(routes: list[Route], path: str, method: str) -> tuple[Route | None, dict[str, str], list[str]]:
    """(route, route params, allowed methods). No route: (None, {}, []) → 404; a route that exists
    for other methods only: (None, {}, allowed) → 405."""
    allowed: list[str] = []
    for route in sorted(routes, key=lambda r: r.precedence):  # a handful: cheap, and any list works
        m = route.pattern.fullmatch(path)
        if not m:
            continue
        if route.allows(method):
            # ``path`` is already percent-decoded once (by the front server), as the Functions host
            # hands route values over: decoding again would turn a%2520b into "a b", not "a%20b".
            params = {k: v for k, v in m.groupdict().items() if v is not None}
            return route, params, []
        allowed.extend(m for m in sorted(route.methods) if m not in allowed)
    return None, {}, allowed
