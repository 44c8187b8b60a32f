"""The documents against the code they describe: each check fails when the two drift apart, with a
message that says what to change.

README.md's settings tables
---------------------------
The tables under README's ``## Settings`` whose header is ``| setting | default | meaning |`` list
exactly the app's own settings: every field of ``chatstream.settings.Settings``, by its alias (the
environment variable the app reads), with the field's default; and nothing else.

A name read by other code belongs to the document of that code, not to these tables (README's prose
may still mention it):

- the local host's (``DEVHOST_*``, ``CORS_ALLOWED_ORIGINS``, ``FUNCTIONS_WORKER_PROCESS_COUNT``,
  ``PORT``): tools/devhost/README.md, whose ``DEVHOST_*`` rows are checked below against
  tools/devhost/config.py and the host's ``--help``;
- telemetry's (``APPLICATIONINSIGHTS_CONNECTION_STRING``,
  ``PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY``, ``OTEL_*``): docs/observability.md;
- the platform's or a library's (``WEBSITE_*``, ``AZURE_CLIENT_ID``, ``FUNCTIONS_WORKER_RUNTIME``,
  ``PYTHON_ENABLE_INIT_INDEXING``, ``AzureWebJobsStorage``): docs/deploy.md and the prose around
  the tables;
- the settings an ``UPSTREAMS`` entry names in ``api_key_setting``: their names are the user's
  (docs/pool.md).

A new setting of the app is a field of ``Settings`` and a row here. The default column says the
field's default: a value (``10`` for ``10.0``, ``gpt-4o-mini``, ``true``; digits may be grouped with
``,``), possibly followed by a note; or, when the field defaults to nothing (None, an empty list) or
is required, ``–`` or a description in parentheses of what unset means (``(any)``).

The same settings and the deployment (infra/)
---------------------------------------------
Every setting of ``Settings`` reaches an Azure deployment and stays there across ``azd up``: either
the template owns it (it derives it from its own parameters; docs/deploy.md's "App settings" table
names the azd value that sets it, mapped in infra/main.parameters.json), or it passes unchanged
through ``CHAT_APP_SETTINGS`` into the settings a deployment writes. So a new setting needs nothing
in infra/ unless the template must own it. Whatever the template writes itself that is not the
platform's (storage, telemetry, identity) is a setting of the app, or one announced below.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from servers import ROOT

README = ROOT / "README.md"
HEADER = ["setting", "default", "meaning"]


def _section(text: str, title: str) -> str:
    """The text of the ``## title`` section (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Markdown tables in ``text``: (header cells, rows of cells)."""
    tables = []
    for block in re.findall(r"(?:^\|.*\|[ \t]*\n?)+", text, re.M):
        lines = [line.strip() for line in block.strip().splitlines()]
        cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
        if len(cells) >= 2 and all(set(c) <= set("-: ") for c in cells[1]):
            tables.append((cells[0], cells[2:]))
    return tables


def _name(cell: str) -> str | None:
    m = re.fullmatch(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)
    return m.group(1) if m else None


def readme_settings() -> tuple[dict[str, str], list[str]]:
    """{setting: its default cell} from README's settings tables, and the problems found reading them."""
    rows: dict[str, str] = {}
    problems: list[str] = []
    tables = [
        rows_
        for header, rows_ in _tables(_section(README.read_text(encoding="utf-8"), "Settings"))
        if [h.lower() for h in header] == HEADER
    ]
    if not tables:
        problems.append("README.md has no `| setting | default | meaning |` table under '## Settings'")
    for table in tables:
        for cells in table:
            name = _name(cells[0])
            if name is None:
                problems.append(
                    f"README.md settings row {cells[0]!r}: the first cell must be one setting name in backticks"
                )
            elif name in rows:
                problems.append(f"README.md lists {name} twice in its settings tables")
            else:
                rows[name] = cells[1]
    return rows, problems


def _code_default(field):
    """The field's default, or None when it has none (required)."""
    if field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return getattr(value, "value", value)  # an enum member: its value


def _unset(value) -> bool:
    return value is None or (isinstance(value, (tuple, list, set, frozenset, dict, str)) and not value)


def suggested_cell(value) -> str:
    if _unset(value):
        return "–"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return f"`{value}`"


def default_matches(cell: str, value) -> bool:
    cell = cell.strip()
    if _unset(value):
        return cell.startswith(("–", "("))
    m = re.match(r"`([^`]*)`|([^\s(]+)", cell)
    if not m:
        return False
    written = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    if isinstance(value, bool):
        return written.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(written.replace(",", "").replace("_", "")) == float(value)
        except ValueError:
            return False
    return written == str(value)


def code_settings() -> tuple[dict[str, tuple[str, object]], list[str]]:
    """{environment name: (field name, default)} of chatstream.settings.Settings, and problems."""
    from chatstream.settings import Settings

    settings, problems = {}, []
    for field_name, field in Settings.model_fields.items():
        alias = field.alias or (field.validation_alias if isinstance(field.validation_alias, str) else None)
        if not alias:
            problems.append(
                f"Settings.{field_name} (chatstream/settings.py) has no alias: the app reads each "
                f'setting by its environment name, Field(..., alias="NAME")'
            )
            continue
        settings[alias] = (field_name, _code_default(field))
    return settings, problems


def test_readme_settings_tables_match_the_code():
    rows, problems = readme_settings()
    settings, code_problems = code_settings()
    problems += code_problems
    for alias, (field_name, default) in settings.items():
        if alias not in rows:
            problems.append(
                f"README.md has no row for {alias} (Settings.{field_name} in chatstream/settings.py). Add one to "
                f"a `| setting | default | meaning |` table under '## Settings':\n"
                f"    | `{alias}` | {suggested_cell(default)} | <what it does, and its limits> |"
            )
        elif not default_matches(rows[alias], default):
            problems.append(
                f"README.md gives {alias} the default {rows[alias]!r}; the code's is {default!r} "
                f"(Settings.{field_name}). Write its default cell as: {suggested_cell(default)}"
                + (" (or a description in parentheses of what unset means)" if _unset(default) else "")
            )
    for name in rows:
        if name not in settings:
            problems.append(
                f"README.md's settings tables list {name}, which is no field of chatstream.settings.Settings. "
                f"If the app reads it, make it a Settings field; if other code reads it, document it where "
                f"that code is documented (see tests/test_docs.py's docstring); otherwise remove the row."
            )
    assert not problems, "\n".join(problems)


def test_the_settings_check_reports_what_to_add():
    """The check's own logic on the cases it exists for: a missing setting, a wrong default."""
    assert suggested_cell(None) == "–" and suggested_cell(()) == "–"
    assert suggested_cell(10.0) == "10" and suggested_cell(1_048_576) == "1048576"
    assert suggested_cell(False) == "`false`" and suggested_cell("gpt-4o-mini") == "`gpt-4o-mini`"
    assert default_matches("10", 10.0) and default_matches("1,048,576 (1 MiB)", 1_048_576)
    assert default_matches("`2024-10-21`", "2024-10-21") and default_matches("`true`", True)
    assert default_matches("(any)", ()) and default_matches("– (OpenAI's own API)", None)
    assert not default_matches("15", 10.0) and not default_matches("–", 10.0)
    assert not default_matches("`gpt-4o`", "gpt-4o-mini") and not default_matches("10", None)


# ------------------------------------------------------------------------- the local host's settings

DEVHOST_README = ROOT / "tools" / "devhost" / "README.md"


def test_devhost_readme_limits_match_its_config_and_help():
    """tools/devhost/README.md's settings table: every DEVHOST_* variable of tools/devhost/config.py
    with its default and the flag that `python -m tools.devhost --help` pairs with it."""
    from dataclasses import fields

    from tools.devhost.config import FRONT_ENV, FrontSettings

    defaults = {f.name: f.default for f in fields(FrontSettings)}
    help_text = subprocess.run(
        [sys.executable, "-m", "tools.devhost", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    ).stdout
    flags = {m.group(2): m.group(1) for m in re.finditer(r"(--[a-z-]+) \w+\s+.*?\[([A-Z_]+)\]", help_text)}
    tables = [
        (header, rows)
        for header, rows in _tables(DEVHOST_README.read_text(encoding="utf-8"))
        if [h.lower() for h in header][:3] == ["environment variable", "flag", "default"]
    ]
    assert tables, "tools/devhost/README.md has no `| environment variable | flag | default | meaning |` table"
    rows = {}
    for _, table in tables:
        for cells in table:
            for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]):
                rows[name] = cells
    problems = []
    for name, (field_name, _kind) in FRONT_ENV.items():
        default = defaults[field_name]
        if name not in rows:
            problems.append(
                f"tools/devhost/README.md has no row for {name}: add\n"
                f"    | `{name}` | `{flags.get(name, '--?')}` | {suggested_cell(default)} | <meaning> |"
            )
            continue
        if flags.get(name) and f"`{flags[name]}`" not in rows[name][1]:
            problems.append(f"tools/devhost/README.md: {name}'s flag is {flags[name]} (--help), not {rows[name][1]}")
        if not default_matches(rows[name][2], default):
            problems.append(
                f"tools/devhost/README.md: {name}'s default is {suggested_cell(default)} "
                f"(FrontSettings.{field_name}), not {rows[name][2]!r}"
            )
    for name in rows:
        if name.startswith("DEVHOST_") and name not in FRONT_ENV:
            problems.append(f"tools/devhost/README.md lists {name}, which tools/devhost/config.py does not read")
    assert flags, f"no [VARIABLE] found in the host's --help:\n{help_text}"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------- server-sent event samples


def _markdown_files():
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "client_cs" / "README.md",
        *sorted((ROOT / "tools").glob("*/README.md")),
    ]


def _chat_samples() -> dict[str, str]:
    """Every fenced block in the docs that shows an /api/chat stream (it has a `data: {"delta"` line)."""
    samples = {}
    for path in _markdown_files():
        text = path.read_text(encoding="utf-8")
        for n, block in enumerate(re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)):
            if re.search(r'^data: \{"delta"', block, re.M):
                samples[f"{path.relative_to(ROOT)} (block {n + 1})"] = block
    return samples


def sse_problems(text: str) -> list[str]:
    """What in an /api/chat stream differs from how the app writes one: JSON other than compact
    (no spaces after separators, raw UTF-8), a comment after the first data line, or a last event
    other than `done` or `error`."""
    problems = []
    seen_data = False
    events = [e for e in re.split(r"\n\n+", text.replace("\r\n", "\n").strip("\n")) if e]
    for event in events:
        for line in event.split("\n"):
            if line.startswith(":"):
                if seen_data:
                    problems.append(
                        f"comment {line!r} after the first data line: the app sends keep-alives "
                        f"only while it waits for the first output"
                    )
            elif line.startswith("data: "):
                seen_data = True
                payload = line[len("data: ") :]
                compact = json.dumps(json.loads(payload), ensure_ascii=False, separators=(",", ":"))
                if payload != compact:
                    problems.append(f"{line!r} is not written as the app writes JSON: data: {compact}")
    if not events or not re.match(r"event: (done|error)\ndata: ", events[-1]):
        problems.append(f"the last event is not `event: done` or `event: error`: {events[-1:]!r}")
    return problems


def test_sse_samples_in_the_docs_are_written_as_the_app_writes_them(start_app):
    """The app's own stream first (keep-alives while the first token is slow, compact JSON), then
    every sample of one in the docs against the same rules."""
    app = start_app(HEARTBEAT_SECONDS="0.05")
    import httpx

    r = httpx.post(app.chat_url, json={"prompt": "[scenario:slow] sample"}, timeout=20)
    assert r.status_code == 200
    assert r.text.startswith(": keep-alive\n\n"), r.text[:200]
    assert re.search(r'^data: \{"delta":"[^"]+"\}$', r.text, re.M), r.text[:300]
    assert sse_problems(r.text) == [], r.text
    samples = _chat_samples()
    assert samples, "no /api/chat stream sample found in the docs"
    problems = {name: sse_problems(block) for name, block in samples.items()}
    assert not any(problems.values()), "\n".join(f"{name}: {p}" for name, ps in problems.items() for p in ps)


def _sse_events(text: str) -> list[tuple[int, str, str]]:
    """(id, event name, data) of each event with an id in an SSE text."""
    found = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and not line.startswith(":"))
        if "id" in fields:
            found.append((int(fields["id"]), fields.get("event", "message"), fields.get("data", "")))
    return found


def test_the_local_resumable_example_runs_as_written(upstream, azurite, tmp_path):
    """docs/resumable.md's "Try it locally": its client block, run by bash against an app served as
    its first block serves it, gets the whole answer across the cut, each event once, ending in done."""
    import httpx
    from helpers import app_env
    from servers import App

    section = _section((ROOT / "docs" / "resumable.md").read_text(encoding="utf-8"), "Try it locally")
    serve, client = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert serve.startswith("RESUMABLE_STREAMS=on make serve"), serve
    app = App(app_env(upstream, AzureWebJobsStorage=azurite.connection_string, RESUMABLE_STREAMS="on"))
    try:
        script = client.replace("localhost:7071", app.url.removeprefix("http://"))
        for _ in range(3):  # a loaded machine may not send the first event within the block's 1 s cut
            run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
            if "id:" in (tmp_path / "part.txt").read_text(encoding="utf-8"):
                break
        whole = httpx.post(app.chat_url, json={"prompt": "[scenario:slow] hi"}, timeout=30).text
    finally:
        app.stop()
    part = _sse_events((tmp_path / "part.txt").read_text(encoding="utf-8"))
    rest = _sse_events(run.stdout)
    ids = [i for i, _, _ in part + rest]
    assert ids == list(range(1, len(ids) + 1)), f"a gap or a repeat across the cut: {ids}\n{run.stderr}"
    assert rest and rest[-1][1] == "done", run.stdout[-500:]
    text = "".join(json.loads(d)["delta"] for _, name, d in part + rest if name == "message")
    expected = "".join(json.loads(d)["delta"] for _, name, d in _sse_events(whole) if name == "message")
    assert text and text == expected, (text, expected)


# ------------------------------------------------------------------------- counted and named things


def test_playground_docs_name_every_file_it_serves():
    files = sorted(p.name for p in (ROOT / "chatstream" / "playground").iterdir() if p.is_file())
    readme_layout = _section((ROOT / "docs" / "maintainers.md").read_text(encoding="utf-8"), "Layout")
    playground_md = (ROOT / "docs" / "playground.md").read_text(encoding="utf-8")
    for name in files:
        assert name in readme_layout, f"docs/maintainers.md's layout does not name chatstream/playground/{name}"
        assert name in playground_md, f"docs/playground.md does not name chatstream/playground/{name}"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    for m in re.finditer(rf"\b({'|'.join(words)}|\d+) (?:[\w-]+ )?files\b", playground_md):
        count = int(m.group(1)) if m.group(1).isdigit() else words.index(m.group(1)) + 1
        assert count == len(files), f"docs/playground.md says {m.group(0)!r}; chatstream/playground has {files}"


def test_readme_tests_section_states_no_figure_that_changes_with_every_commit():
    """How many tests there are and how long they take change with every commit: README leaves them
    out (a script that measured them could write them)."""
    section = _section(README.read_text(encoding="utf-8"), "Tests")
    figures = re.findall(
        r"\b\d[\d,.]* (?:tests|test cases)\b|\b(?:about|in) \d[\d.]* ?(?:s|seconds|minutes)\b", section
    )
    assert not figures, f"README.md's Tests section states {figures}"


def test_readme_scenarios_exist_in_the_scripted_upstream():
    from tools.fakeupstream.scenarios import SCENARIOS

    rows = [
        rows for header, rows in _tables(README.read_text(encoding="utf-8")) if header and "[scenario:" in header[0]
    ]
    assert rows, "README.md has no `[scenario:NAME]` table"
    named = [_name(cells[0]) for cells in rows[0]]
    unknown = [name for name in named if name not in SCENARIOS]
    assert not unknown, f"README.md names scenarios that tools/fakeupstream does not have: {unknown}"


def test_openai_md_says_who_can_read_cancel_or_delete_a_stored_response():
    """Issue #23 item 13: plainly, with and without callers. The behaviour it states is tested:
    test_follow_ups.py::test_without_callers_the_function_key_reaches_any_stored_response and
    test_callers.py::test_a_response_belongs_to_the_caller_that_created_it."""
    text = (ROOT / "docs" / "openai.md").read_text()
    heading = "### Who can read, cancel or delete a stored response"
    assert heading in text, f"docs/openai.md needs a section {heading!r}"
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    for claim in (
        "function key",
        "**any** response id",
        "same OpenAI or Azure OpenAI account",
        "CALLER_KEYS=required",
        "`404`",
        '"store": false',
    ):
        assert claim in section, f"the section should say {claim!r}"


# ------------------------------------------------------------------------- settings and the deployment

# Settings that this round's other work adds to chatstream/settings.py (each with its README row); the
# deployment already writes CONSOLE_ENABLED=false, like PLAYGROUND_ENABLED. Once a name here is a field
# of Settings it is checked like every other, and it can leave this list.
ANNOUNCED_SETTINGS = {
    "CONTINUE_ON_UPSTREAM_FAILURE",
    "CONTINUE_MAX",
    "DRAIN_SECONDS",
}
# What the template writes for the platform, not for the app (docs/deploy.md).
PLATFORM_SETTINGS = re.compile(
    r"AzureWebJobsStorage__\w+|APPLICATIONINSIGHTS_\w+|PYTHON_APPLICATIONINSIGHTS_\w+|OTEL_\w+|AZURE_CLIENT_ID|AzureWebJobsFeatureFlags|ASPNETCORE_SHUTDOWNTIMEOUTSECONDS"
)


def _owned_table(deploy_md: str) -> dict[str, str]:
    """docs/deploy.md's "App settings" table of the settings the template owns: {name: its "set by" cell}."""
    section = _section_any(deploy_md, "App settings")
    tables = [rows for header, rows in _tables(section) if [h.lower() for h in header] == ["app setting", "set by"]]
    assert tables, "docs/deploy.md's App settings section has no `| app setting | set by |` table"
    owned = {}
    for cells in tables[0]:
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[0]):
            owned[name] = cells[1]
    return owned


def _section_any(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no '## {title}' section"
    return m.group(1)


def test_every_setting_reaches_the_deployment_and_stays():
    """README's settings tables, chatstream/settings.py and infra/ agree (see the docstring above)."""
    from test_infra import Infra

    infra = Infra.from_disk()
    settings, problems = code_settings()
    rows, _ = readme_settings()
    deploy_md = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    owned_doc = _owned_table(deploy_md)
    azd_values = {
        m.group(1)
        for entry in json.loads((ROOT / "infra" / "main.parameters.json").read_text())["parameters"].values()
        for m in re.finditer(r"\$\{(\w+)", str(entry["value"]))
    }
    owned = {}
    for mode in ("azureOpenAI", "openAI"):
        owned.update(infra.settings_layers(mode)["templateSettings"])
    for alias in sorted(set(settings) | set(rows)):
        if alias in owned:
            if alias not in owned_doc:
                problems.append(
                    f"infra/ sets {alias} itself, and docs/deploy.md's `| app setting | set by |` table does not say "
                    f"what sets it (add a row, naming the azd value)"
                )
                continue
            named = re.findall(r"`([A-Z][A-Z0-9_]*)`", owned_doc[alias]) if "azd `" in owned_doc[alias] else []
            for value in named:
                if value not in azd_values:
                    problems.append(
                        f"docs/deploy.md: {alias} is set by azd {value}, which infra/main.parameters.json does not map"
                    )
            continue
        try:
            written = infra.app_settings("azureOpenAI", appSettings={alias: "probe-value"})
        except Exception as refused:  # the template refuses it, or its evaluation broke
            problems.append(f"CHAT_APP_SETTINGS cannot set {alias}: {refused}")
            continue
        if written.get(alias) != "probe-value":
            problems.append(f"CHAT_APP_SETTINGS={{{alias!r}: ...}} does not reach the app settings a deployment writes")
    for mode in ("azureOpenAI", "openAI"):
        layers = infra.settings_layers(mode)
        for name in {**layers["templateDefaults"], **layers["templateSettings"]}:
            if not PLATFORM_SETTINGS.fullmatch(name) and name not in settings and name not in ANNOUNCED_SETTINGS:
                problems.append(
                    f"infra/ writes {name}, which is no setting of chatstream/settings.py (nor the platform's)"
                )
    for name in owned_doc:
        if name not in owned and not PLATFORM_SETTINGS.fullmatch(name):
            problems.append(f"docs/deploy.md says infra/ owns {name}; it does not")
    assert not problems, "\n".join(problems)


_PATH = re.compile(
    r"(?<![\w/.-])((?:chatstream|tools|tests|infra|clients|client_cs|docs)/[\w./-]*\w\.(?:py|md|bicep|mjs|json|sh|cs|png|proto))"
)
_PACKAGE_PATH = re.compile(r"(?<![\w/.-])((?:state|apis|upstreams|streamlog)/\w+\.py)")


def test_every_file_a_docstring_or_doc_names_exists():
    """A docstring or a doc that names a module that is gone misleads its reader (the stream log's
    once named state/streamlog.py and stream_remote.py, long after they had moved)."""
    sources = [
        *ROOT.glob("chatstream/**/*.py"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        ROOT / "function_app.py",
        *ROOT.glob("tools/**/*.py"),
        *ROOT.glob("tools/*/README.md"),
        *ROOT.glob("clients/**/*.md"),
    ]
    skip = {"node_modules", ".venv", "_generated", "out"}
    missing = []
    for source in sources:
        if skip & set(source.relative_to(ROOT).parts):
            continue
        text = source.read_text(errors="replace")
        for match in _PATH.finditer(text):
            if match.group(1).startswith("tools/bench/out/"):
                continue  # what a bench run writes
            if not (ROOT / match.group(1)).exists():
                missing.append(f"{source.relative_to(ROOT)} names {match.group(1)}")
        for match in _PACKAGE_PATH.finditer(text):
            if not any((ROOT / base / match.group(1)).exists() for base in ("chatstream", "chatstream/state")):
                missing.append(f"{source.relative_to(ROOT)} names {match.group(1)}")
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------------- how long the docs are

# The documents a user reads to use the app (the benchmarks, scaling and the maintainers' notes are
# not among them). Together they stay short enough to be read: say a thing once, and link to it.
USER_DOCS = [
    "README.md",
    "docs/api.md",
    "docs/openai.md",
    "docs/callers.md",
    "docs/resumable.md",
    "docs/deploy.md",
    "docs/production.md",
    "docs/playground.md",
    "docs/pool.md",
    "docs/pipeline.md",
]
USER_DOCS_MAX_WORDS = 18_000  # issue #43
# Every document: the user docs, and the maintainers' (benchmarks, scaling, reliability, ...), whose
# internals belong in the modules' docstrings.
ALL_DOCS_MAX_WORDS = 24_000  # issue #43


def words(data: bytes) -> int:
    """Words as ``wc -w`` counts them: runs of characters between ASCII white space."""
    return len(re.findall(rb"[^ \t\n\v\f\r]+", data))


def test_defaults_quoted_in_prose_are_the_defaults():
    """Wherever a doc quotes a setting with its default in brackets, `DRAIN_SECONDS` (20) or
    `RESUME_TTL_SECONDS` (600 s), the figure is the app's default (chatstream/settings.py)."""
    from chatstream.settings import Settings

    defaults = {f.alias: f.default for f in Settings.model_fields.values()}
    found, wrong = 0, []
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"`([A-Z][A-Z0-9_]+)` \((\d[\d,.]*)(?: ?s| seconds)?[),;]", text):
            name, figure = m.group(1), m.group(2)
            if name not in defaults:
                continue
            found += 1
            default = defaults[name]
            if default is None or float(figure.replace(",", "")) != float(default):
                wrong.append(f"{path.relative_to(ROOT)}: {m.group(0)} but the default is {default!r}")
    assert found >= 5, f"only {found} quoted defaults found: is the pattern still right?"
    assert not wrong, "\n".join(wrong)


def test_the_user_docs_stay_within_their_word_budget():
    counts = {name: words((ROOT / name).read_bytes()) for name in USER_DOCS}
    total = sum(counts.values())
    table = "\n".join(f"{count:7,} {name}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"\n{table}\n{total:7,} in all (at most {USER_DOCS_MAX_WORDS:,})")
    assert total <= USER_DOCS_MAX_WORDS, (
        f"the user-facing docs are {total:,} words, more than {USER_DOCS_MAX_WORDS:,}: shorten them (say a thing "
        f"once and link to it; design notes go below the line or into the module's docstring)\n{table}"
    )


def test_all_docs_stay_within_their_word_budget():
    paths = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert {str(p.relative_to(ROOT)) for p in paths} >= set(USER_DOCS), "the user docs are among all docs"
    counts = {str(p.relative_to(ROOT)): words(p.read_bytes()) for p in paths}
    total = sum(counts.values())
    table = "\n".join(f"{count:7,} {name}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"\n{table}\n{total:7,} in all (at most {ALL_DOCS_MAX_WORDS:,})")
    assert total <= ALL_DOCS_MAX_WORDS, (
        f"README.md and docs/*.md are {total:,} words, more than {ALL_DOCS_MAX_WORDS:,}: shorten them (internals "
        f"go into the module's docstring; generated tables say only what a reader needs)\n{table}"
    )


def test_words_are_counted_as_wc_counts_them():
    assert words(b"") == 0 and words(b"  one\ttwo\n\nthree  ") == 3
    assert words("`a|b` — ünï 日本語\r\n".encode()) == 4
    wc = subprocess.run(["wc", "-w"], input=(ROOT / "README.md").read_bytes(), capture_output=True, timeout=30)
    assert int(wc.stdout.split()[0]) == words((ROOT / "README.md").read_bytes())
