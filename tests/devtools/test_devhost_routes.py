"""tools/devhost/routes.py in-process: which function a path reaches, like the Functions host
(ASP.NET routing): literal segments beat parameters, parameters beat catch-alls, whatever order the
functions were declared (indexed) in."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from tools.devhost.routes import match, routes_from_metadata


def function(name: str, route: str, methods=("GET",)):
    binding = {
        "type": "httpTrigger",
        "direction": "in",
        "name": "req",
        "route": route,
        "methods": list(methods),
        "authLevel": "anonymous",
    }
    return SimpleNamespace(
        function_id=f"id-{name}",
        name=name,
        raw_bindings=[json.dumps(binding), json.dumps({"type": "http", "direction": "out", "name": "$return"})],
    )


# The app's OpenAI-compatible routes, with the catch-all it is about to add.
OPENAI = [
    function("openai_catch_all", "v1/{*rest}", methods=()),  # any method
    function("openai_chat", "v1/chat/completions", methods=("POST",)),
    function("openai_models", "v1/models"),
    function("openai_model", "v1/models/{id}"),
    function("chat", "chat", methods=("POST",)),
]


SHORT = {
    "openai_catch_all": "all",
    "openai_chat": "completions",
    "openai_models": "models",
    "openai_model": "model",
    "chat": "chat",
}


def _reached(functions, path: str, method: str):
    route, params, allowed = match(routes_from_metadata(functions, "api"), path, method)
    return (route.name if route else None), params, allowed


@pytest.mark.parametrize(
    "order",
    [OPENAI, OPENAI[::-1]] + [list(p) for p in itertools.islice(itertools.permutations(OPENAI), 7, None, 17)],
    ids=lambda o: ",".join(SHORT[f.name] for f in o),
)
def test_literals_beat_parameters_beat_catch_alls_in_any_declaration_order(order):
    assert _reached(order, "/api/v1/chat/completions", "POST") == ("openai_chat", {}, [])
    assert _reached(order, "/api/v1/models", "GET") == ("openai_models", {}, [])
    assert _reached(order, "/api/v1/models/gpt-4o", "GET") == ("openai_model", {"id": "gpt-4o"}, [])
    assert _reached(order, "/api/V1/Models/", "GET")[0] == "openai_models"  # case-insensitive, trailing slash
    assert _reached(order, "/api/v1/embeddings", "POST") == ("openai_catch_all", {"rest": "embeddings"}, [])
    assert _reached(order, "/api/v1/models/a/b", "GET") == ("openai_catch_all", {"rest": "models/a/b"}, [])
    assert _reached(order, "/api/chat", "POST")[0] == "chat"
    # A path whose specific route exists for other methods only falls through to the catch-all,
    # as under ASP.NET endpoint routing (the method is part of the match).
    assert _reached(order, "/api/v1/chat/completions", "GET")[0] == "openai_catch_all"
    assert _reached(order, "/api/nope", "GET") == (None, {}, [])


def test_405_lists_the_methods_of_the_routes_that_match_the_path():
    functions = [f for f in OPENAI if f.name != "openai_catch_all"]
    for order in (functions, functions[::-1]):
        assert _reached(order, "/api/v1/chat/completions", "GET") == (None, {}, ["POST"])


@pytest.mark.parametrize(
    "templates, path, expected",
    [
        (["items/{id}", "items/new"], "/api/items/new", "items/new"),
        (["items/{id}", "items/new"], "/api/items/7", "items/{id}"),
        (["files/{*path}", "files/{name}"], "/api/files/a.txt", "files/{name}"),
        (["files/{*path}", "files/{name}"], "/api/files/a/b.txt", "files/{*path}"),
        (["{*all}", "a/{b}/c", "a/{b}/{c}"], "/api/a/x/c", "a/{b}/c"),
        (["{*all}", "a/{b}/c", "a/{b}/{c}"], "/api/a/x/y", "a/{b}/{c}"),
        (["{*all}", "a/{b}/c", "a/{b}/{c}"], "/api/a/x/y/z", "{*all}"),
        (["a/{b?}", "a"], "/api/a", "a"),
        (["a/{b?}", "a"], "/api/a/x", "a/{b?}"),
        (["{x}/literal", "literal/{x}"], "/api/literal/literal", "literal/{x}"),  # the first segment decides
    ],
)
def test_precedence_does_not_depend_on_declaration_order(templates, path, expected):
    for order in itertools.permutations(templates):
        functions = [function(f"f{i}", t) for i, t in enumerate(order)]
        route, _, _ = match(routes_from_metadata(functions, "api"), path, "GET")
        assert route is not None and route.template == expected, (order, route and route.template)


def test_routes_the_functions_host_keeps_for_itself_are_in_error_here_too(caplog):
    """As in Azure: a route that starts with `admin` (or `runtime`) puts its function in error, even
    under the `api` prefix, so a local run shows what a deployment would (the app's admin API is
    under /api/manage for that reason)."""
    functions = [
        function("admin_callers", "admin/callers"),
        function("hooks", "Runtime/x"),
        function("manage", "manage/callers"),
        function("administer", "administer"),
    ]
    with caplog.at_level("ERROR", logger="devhost"):
        names = [r.name for r in routes_from_metadata(functions, "api")]
    assert names == ["manage"]
    assert sum("conflicts with one or more built in routes" in r.getMessage() for r in caplog.records) == 3


def test_a_line_feed_in_the_path_still_reaches_a_route_as_in_asp_net():
    """Issue #23 item 17: a catch-all takes any character, %0A decoded to a line feed too."""
    assert _reached(OPENAI, "/api/v1/x\ny", "GET")[0] == "openai_catch_all"
    assert _reached(OPENAI, "/api/v1/chat/completions\n", "POST")[0] == "openai_catch_all"
    name, params, _ = _reached(OPENAI, "/api/v1/models/a\r\nb", "GET")
    assert (name, params) == ("openai_model", {"id": "a\r\nb"})
