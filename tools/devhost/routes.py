"""HTTP routes of the indexed functions: route templates from the function metadata, matched like
the Functions host (case-insensitive literals, ``{name}``, ``{name?}``, ``{*rest}``, constraints
such as ``{id:int}`` accepted and ignored)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

_PARAM = re.compile(r"^\{(\*)?([A-Za-z_][A-Za-z0-9_]*)(?::[^}?]*)?(\?)?\}$")


@dataclass(frozen=True)
class Route:
    function_id: str
    name: str
    trigger_param: str
    methods: frozenset[str]  # empty: any method
    template: str
    pattern: re.Pattern = field(compare=False, repr=False)

    def allows(self, method: str) -> bool:
        return not self.methods or method.upper() in self.methods


def _compile(prefix: str, template: str) -> re.Pattern:
    parts = [p for p in (prefix.strip("/") + "/" + template.strip("/")).split("/") if p]
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
    return re.compile((regex or "/") + "/?", re.IGNORECASE)


def routes_from_metadata(metadata, prefix: str) -> list[Route]:
    """One Route per function whose trigger is an httpTrigger."""
    routes = []
    for fn in metadata:
        for raw in fn.raw_bindings:
            binding = json.loads(raw)
            if binding.get("type") != "httpTrigger":
                continue
            template = binding.get("route") or fn.name
            methods = frozenset(m.upper() for m in binding.get("methods") or ())
            routes.append(Route(fn.function_id, fn.name, binding["name"], methods, template,
                                _compile(prefix, template)))
    return routes


def match(routes: list[Route], path: str, method: str) -> tuple[Route | None, dict[str, str], list[str]]:
    """(route, route params, allowed methods). No route: (None, {}, []) → 404; a route that exists
    for other methods only: (None, {}, allowed) → 405."""
    allowed: list[str] = []
    for route in routes:
        m = route.pattern.fullmatch(path)
        if not m:
            continue
        if route.allows(method):
            params = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
            return route, params, []
        allowed.extend(sorted(route.methods))
    return None, {}, allowed
