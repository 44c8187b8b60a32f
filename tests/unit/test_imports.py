"""chatstream/ imports in one direction: no module imports, directly or through others, a module
that imports it (imports inside functions count too). A circle is what made the store's factory and
its backends hard to follow (issue 45)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "chatstream").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            # ``from . import x`` imports the module x (its package is being imported already).
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
            out.update(submodules or ({target} & modules.keys()))
    out.discard(name)
    return out


def test_no_module_of_chatstream_imports_itself_in_a_circle():
    modules = _modules()
    assert "chatstream.state.store" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "chatstream.state.store" in graph["chatstream.state.store_azure"]  # the edges are found
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"an import circle: {' -> '.join(exc.args[1])}") from None


# What chatstream/state/ may use outside itself: the app's errors, the tokenizer, the settings and
# the SSE framing its stream log shares with the API encoders. Never the request path's objects
# (pipeline.py's CallRequest, record.py's StreamRecord), the API adapters, HTTP or the endpoint: the
# API layer hands the state domain values (state/port.py), issue 45.
STATE_MAY_USE = frozenset({"chatstream.errors", "chatstream.tokens", "chatstream.settings", "chatstream.sse"})


def test_the_state_imports_nothing_of_the_request_path():
    modules = _modules()
    outside = {
        f"{name} -> {used}"
        for name, path in modules.items()
        if name.startswith("chatstream.state.") or name == "chatstream.state"
        for used in _imports(name, path, modules)
        if not used.startswith("chatstream.state") and used not in STATE_MAY_USE
    }
    assert "chatstream.state.accounting" in modules  # the walk finds the state's modules
    assert not outside, f"the state imports the request path: {sorted(outside)}"
