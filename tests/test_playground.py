"""The browser playground, GET /api/playground (chatstream/pages.py, chatstream/playground/).

Over HTTP: when it is served (PLAYGROUND_ENABLED, else on locally and off in Azure), which files,
with which headers, and that the route needs no function key. In a browser: Debian's headless
Chromium, driven through Playwright's sync API (no browser download), against the app on the local
host and the scripted upstream, finding every control by its accessible name as a screen reader
would. Each browser test also checks that the page asked no other origin for anything and logged no
console errors.

Covered: the serving table, a bad setting, the infra setting, the headers and files, unknown names
(``../``, NUL, other case), the routes' auth levels, the answer growing delta by delta and ending
exact, Stop closing the upstream within a second, the conversation and New chat, errors, markup
shown as text, the key field, the parser at every split, and, on Azurite, a reload mid-answer, a
connection cut by a proxy once and three times, going offline, Stop as a cancel, an early replay and
a ``stream_store_unavailable`` event, and caller keys on the resume and cancel. ``make chromium``
installs the browser (never ``playwright install``). The screenshot of docs/playground.md:
``PLAYGROUND_SCREENSHOT=1 .venv/bin/python -m pytest tests/test_playground.py -k grows`` (install
``fonts-noto-color-emoji fonts-noto-cjk`` first for emoji and CJK)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from types import SimpleNamespace

import httpx
import pytest
from browser_tab import Tab, chromium
from helpers import function_bindings
from servers import ROOT

from chatstream import pages
from chatstream.settings import Settings, SettingsError
from tools.fakeupstream.scenarios import COMPLETION_TOKENS, TEXTS, count_prompt_tokens, echo_text

ASSETS = {
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
SCREENSHOT = ROOT / "docs" / "playground.png"


# ------------------------------------------------------------------------------- the decision


@pytest.mark.parametrize(
    "environ,on",
    [
        ({}, True),  # make serve, func start, the tests' app
        ({"WEBSITE_HOSTNAME": "localhost:7071", "AZURE_FUNCTIONS_ENVIRONMENT": "Development"}, True),  # func start
        ({"WEBSITE_INSTANCE_ID": "8a3f"}, False),  # in Azure
        ({"WEBSITE_SITE_NAME": "func-abc"}, False),
        ({"WEBSITE_SITE_NAME": "func-abc", "PLAYGROUND_ENABLED": "true"}, True),
        ({"WEBSITE_INSTANCE_ID": "8a3f", "PLAYGROUND_ENABLED": "1"}, True),
        ({"PLAYGROUND_ENABLED": "false"}, False),
        ({"PLAYGROUND_ENABLED": "False"}, False),
        ({"PLAYGROUND_ENABLED": "0"}, False),
        ({"PLAYGROUND_ENABLED": ""}, True),  # empty is unset
    ],
)
def test_enabled_locally_off_in_azure_and_the_setting_decides(environ, on):
    assert pages.enabled("playground", Settings.from_env(environ), environ) is on


def test_a_bad_setting_stops_the_app_naming_it():
    with pytest.raises(SettingsError, match="PLAYGROUND_ENABLED"):
        Settings.from_env({"PLAYGROUND_ENABLED": "maybe"})


def test_infra_turns_it_off_in_azure():
    from test_infra import MODES, Infra

    infra = Infra.from_disk()
    for mode in MODES:
        assert infra.app_settings(mode).get("PLAYGROUND_ENABLED") == "false", mode


# ------------------------------------------------------------------------------- over HTTP


def test_page_and_files_with_strict_headers(app):
    page = httpx.get(app.url + "/api/playground")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    csp = {d.split()[0]: d.split()[1:] for d in page.headers["content-security-policy"].split("; ")}
    assert csp["default-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]
    assert csp["script-src"] == ["'self'"] and csp["style-src"] == ["'self'"], "no inline script or style"
    assert csp["frame-ancestors"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["cache-control"] == "no-store"
    assert "<script" not in page.text.replace('<script src="playground/playground.js" defer></script>', "")
    assert " style=" not in page.text and "<style" not in page.text and "//" not in re.sub(r"<!--.*?-->", "", page.text)
    for name, content_type in ASSETS.items():
        r = httpx.get(f"{app.url}/api/playground/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"] == content_type
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
        assert r.content == (ROOT / "chatstream" / "playground" / name).read_bytes()
    # With a trailing slash the page's relative URLs would miss: sent back to /api/playground.
    r = httpx.get(app.url + "/api/playground/")
    assert r.status_code == 308 and r.headers["location"] == "../playground"


@pytest.mark.parametrize(
    "path",
    [
        "index.html",
        "nope.js",
        "PLAYGROUND.JS",
        "..%2Ffunction_app.py",
        "%2e%2e%2f%2e%2e%2fhost.json",
        "..%5C..%5Chost.json",
        "playground.js%00",
        "favicon.svg/x",
        "%2e%2e",
    ],
)
def test_only_known_files(app, path):
    r = httpx.get(f"{app.url}/api/playground/{path}")
    assert r.status_code == 404, path
    assert b"def " not in r.content and b"extensionBundle" not in r.content


def test_the_page_needs_no_key_and_the_api_does():
    """The route is anonymous in the function metadata the host reads; every other route keeps the
    app's default (function keys). The local hosts check no keys, so this is where it shows."""
    bindings = function_bindings("OPENAI_", "AZURE_OPENAI_", "PLAYGROUND_")
    assert bindings["playground"]["authLevel"] == "ANONYMOUS"
    assert bindings["playground"]["methods"] == ["GET"]
    # The admin API for callers (chatstream/manage.py) needs the host's master key.
    admin = {name: b["authLevel"] for name, b in bindings.items() if name.startswith("manage_")}
    assert admin and set(admin.values()) == {"ADMIN"}, admin
    # The operators' console is the other anonymous page (tests/test_console.py).
    pages = ("playground", "console")
    others = {name: b["authLevel"] for name, b in bindings.items() if name not in pages and name not in admin}
    assert others and set(others.values()) == {"FUNCTION"}, others


def test_404_when_disabled_by_the_setting(start_app):
    off = start_app(PLAYGROUND_ENABLED="false")
    for path in ("/api/playground", "/api/playground/playground.js", "/api/playground/playground.css"):
        assert httpx.get(off.url + path).status_code == 404, path
    assert httpx.get(off.url + "/api/v1/models").status_code == 200, "only the page is off"


def test_the_model_text_only_ever_becomes_text():
    """No HTML sink in the script: the model's text goes through text nodes only."""
    source = (ROOT / "chatstream" / "playground" / "playground.js").read_text()
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "createContextualFragment",
        "DOMParser",
        "http://",
        "https://",
        "localStorage",
    ):
        assert sink not in source, sink


# ------------------------------------------------------------------------------- in a browser


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


class Page(Tab):
    """One browser tab on the playground, with everything it requested and logged."""

    def __init__(self, browser, app):
        super().__init__(browser, app, 1100, 720)

    def open(self) -> Page:
        response = self.page.goto(self.origin + "/api/playground")
        assert response.status == 200
        self.expect(self.page.get_by_role("combobox", name="Model")).to_have_value("gpt-test")  # models loaded
        return self

    # the page's parts, by accessible name
    @property
    def prompt(self):
        return self.page.get_by_role("textbox", name="Prompt", exact=True)

    @property
    def answer(self):
        return self.page.get_by_role("region", name="Answer")

    @property
    def send_button(self):
        return self.page.get_by_role("button", name="Send")

    @property
    def stop_button(self):
        return self.page.get_by_role("button", name="Stop")

    @property
    def alert(self):
        return self.page.get_by_role("alert")

    @property
    def stats(self):
        return self.page.get_by_role("status")

    def ask(self, text: str) -> None:
        """Type the prompt and press Enter (Shift+Enter would add a line)."""
        self.prompt.fill(text)
        self.prompt.press("Enter")

    def wait_ready(self, timeout: float = 10) -> None:
        self.expect(self.send_button).to_be_enabled(timeout=timeout * 1000)
        self.expect(self.stop_button).to_be_disabled()

    def chat_requests(self) -> list:
        return [r for r in self.requests if r.url.endswith("/api/v1/chat/completions")]


@pytest.fixture
def tab(browser, app):
    page = Page(browser, app).open()
    yield page
    page.close()


def _wait_stream_open(upstream, scenario: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        running = [s for s in upstream.streams() if s["scenario"] == scenario and s["ended_at"] is None]
        if running:
            return running[-1]
        assert time.monotonic() < deadline, f"no open {scenario} stream"
        time.sleep(0.02)


def test_answer_grows_as_the_deltas_arrive_and_ends_exact(tab, upstream, tmp_path):
    """A slow scripted stream (10 deltas, 150 ms apart) watched from the page: the Answer grows, each
    observation longer than the last and a prefix of the final text, which is the scripted text
    exactly (blank lines, quotes, a backslash, emoji, CJK). Then the stats line."""
    page = tab.page
    page.get_by_role("textbox", name="System prompt").fill("Answer in plain text.")
    tab.ask("[scenario:normal] Hi! Show me some text.")  # an earlier turn, for the screenshot
    tab.expect(tab.answer).to_have_text(TEXTS["normal"])
    tab.wait_ready()

    tab.ask("[scenario:slow_normal] Once more, slowly?")
    expected = TEXTS["slow_normal"]
    seen: list[tuple[float, str]] = []
    shot = tmp_path / "playground.png"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = tab.answer.text_content()
        if not seen or text != seen[-1][1]:
            seen.append((time.monotonic(), text))
        if not shot.exists() and len(text) > len(expected) // 2:
            page.screenshot(path=shot)  # mid-stream, for docs/playground.md
        if text == expected:
            break
        time.sleep(0.05)
    texts = [t for _, t in seen if t]
    assert texts[-1] == expected
    assert len(texts) >= 5, f"the answer did not grow in steps: {len(texts)} observations"
    assert all(len(a) < len(b) for a, b in zip(texts, texts[1:])), "each observation longer than the last"
    assert all(expected.startswith(t) for t in texts)
    grown = [at for at, t in seen if t]
    assert grown[-1] - grown[0] > 0.6, "all the text appeared at once"
    tab.wait_ready()
    assert tab.answer.text_content() == expected  # nothing after the end
    assert tab.answer.evaluate("el => getComputedStyle(el).whiteSpace") == "pre-wrap"  # newlines shown
    assert tab.answer.evaluate("el => el.getAttribute('aria-live')") == "polite"
    stats = tab.stats.text_content()
    usage = upstream.requests(last=1)[0]["json"]["messages"]
    assert re.search(r"First delta \d+ ms · 10 deltas, \d+\.\d/s · ", stats), stats
    assert f"tokens: {count_prompt_tokens(usage)} prompt, {COMPLETION_TOKENS['slow_normal']} completion" in stats
    assert stats.endswith("finish: stop"), stats
    body = tab.chat_requests()[-1].post_data_json
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "gpt-test"
    assert shot.exists()
    if os.environ.get("PLAYGROUND_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
    tab.assert_clean()


@pytest.mark.parametrize("scenario,how", [("stall", "button"), ("stall_first", "button"), ("stall", "Escape")])
def test_stop_closes_the_upstream_at_once_and_the_page_is_ready_again(tab, upstream, scenario, how):
    """Stop (or Esc in the prompt) aborts the fetch; the app closes the upstream (the scripted server
    records the hang-up within a second). With text shown (stall) it stays, marked stopped; before
    any text (stall_first: the app has not even sent headers yet) the prompt comes back. Then the
    next prompt works."""
    prompt = f"[scenario:{scenario}] take your time"
    tab.ask(prompt)
    if TEXTS[scenario]:
        tab.expect(tab.answer).to_have_text(TEXTS[scenario])
    _wait_stream_open(upstream, scenario)
    tab.expect(tab.send_button).to_be_disabled()
    clicked = time.time()
    if how == "button":
        tab.stop_button.click()
    else:
        tab.prompt.press("Escape")
    record = upstream.wait_stream_end(scenario, timeout=5)
    assert record["outcome"] == "client_disconnected"
    assert record["ended_at"] - clicked < 1.0, record["ended_at"] - clicked
    tab.wait_ready()
    # Not resumable (no x-stream-id): Stop is the hang-up it always was, nothing kept for a reload.
    assert not [r.url for r in tab.requests if "/api/streams/" in r.url]
    assert tab.page.evaluate("() => sessionStorage.getItem('chatstream.stream')") is None
    tab.expect(tab.page.get_by_text("Stopped.", exact=True)).to_be_visible()
    if TEXTS[scenario]:
        assert tab.answer.text_content() == TEXTS[scenario]
        tab.expect(tab.prompt).to_have_value("")
    else:
        tab.expect(tab.prompt).to_have_value(prompt)
    tab.expect(tab.prompt).to_be_focused()

    tab.ask("[scenario:normal] and now?")
    tab.expect(tab.answer).to_have_text(TEXTS["normal"])
    tab.wait_ready()
    messages = upstream.requests(last=1)[0]["json"]["messages"]
    earlier = [{"role": "user", "content": prompt}, {"role": "assistant", "content": TEXTS[scenario]}]
    assert messages == (earlier if TEXTS[scenario] else []) + [
        {"role": "user", "content": "[scenario:normal] and now?"}
    ]
    tab.assert_clean()


def test_second_turn_sends_the_conversation_and_new_chat_starts_over(tab, upstream):
    page = tab.page
    page.get_by_role("textbox", name="System prompt").fill("Be brief.\nUse plain words.")
    page.get_by_role("spinbutton", name="Temperature").fill("0.5")
    first = "[scenario:echo] What is 2+2?\nAnswer in one word."
    tab.prompt.fill("[scenario:echo] What is 2+2?")
    tab.prompt.press("Shift+Enter")  # a new line, not a send
    tab.prompt.press_sequentially("Answer in one word.")
    tab.expect(tab.prompt).to_have_value(first)
    assert tab.chat_requests() == []
    tab.send_button.click()
    tab.expect(tab.answer).to_have_text(echo_text(first))
    tab.wait_ready()

    second = "[scenario:normal] And 3+3?"
    tab.ask(second)
    tab.expect(tab.answer).to_have_text(TEXTS["normal"])
    tab.wait_ready()
    sent = upstream.requests(last=1)[0]["json"]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief.\nUse plain words."},
        {"role": "user", "content": first},
        {"role": "assistant", "content": echo_text(first)},
        {"role": "user", "content": second},
    ]
    assert sent["temperature"] == 0.5
    conversation = page.get_by_role("region", name="Conversation")
    assert echo_text(first) in conversation.text_content()  # the first turn stays on screen

    page.get_by_role("button", name="New chat").click()
    tab.expect(tab.answer).to_have_text("")
    assert echo_text(first) not in conversation.text_content()
    tab.ask("[scenario:normal] fresh start")
    tab.expect(tab.answer).to_have_text(TEXTS["normal"])
    tab.wait_ready()
    assert upstream.requests(last=1)[0]["json"]["messages"] == [
        {"role": "system", "content": "Be brief.\nUse plain words."},
        {"role": "user", "content": "[scenario:normal] fresh start"},
    ]
    tab.assert_clean()


def test_errors_are_shown_and_partial_text_is_kept(tab):
    """A 429 before the stream: its OpenAI-shaped message with Retry-After, and the prompt back in
    the box. An error event after some text: the text stays, marked cut off, with the reason."""
    prompt = "[scenario:rate_limited] hello"
    tab.ask(prompt)
    tab.expect(tab.alert).to_contain_text("429 rate_limited: Rate limit reached for gpt-test")
    tab.expect(tab.alert).to_contain_text("(Retry-After: 1 s)")
    tab.wait_ready()
    tab.expect(tab.answer).to_have_text("")
    tab.expect(tab.prompt).to_have_value(prompt)
    time.sleep(1.1)  # the app's single upstream keeps the 429's Retry-After (1 s) for that model: wait it out

    tab.ask("[scenario:error_midstream] hello")
    tab.expect(tab.alert).to_contain_text("Stream error: ")
    tab.expect(tab.alert).to_contain_text("(upstream_error)")
    tab.wait_ready()
    assert tab.answer.text_content() == TEXTS["error_midstream"]
    tab.expect(tab.page.get_by_text("Cut off: the answer is incomplete.")).to_be_visible()
    assert tab.stats.text_content().endswith("finish: none")
    # Chromium itself notes every HTTP error status in the console; nothing else is allowed.
    tab.assert_clean(expected_console=r"^Failed to load resource: the server responded with a status of 429")


def test_markup_in_the_answer_is_shown_as_text_and_runs_nothing(tab):
    tab.page.evaluate("() => { window.__xss = undefined; }")
    tab.ask("[scenario:html] show me markup")
    tab.expect(tab.answer).to_have_text(TEXTS["html"])
    tab.wait_ready()
    assert "<img src=x onerror=alert(1)>" in tab.answer.text_content()
    assert tab.answer.locator("*").count() == 0, "no element was made from the text"
    assert tab.page.locator("img, script:not([src])").count() == 0
    tab.page.wait_for_timeout(300)  # an onerror would have fired by now
    assert tab.page.evaluate("() => window.__xss") is None
    tab.assert_clean()  # includes: no dialog (alert) opened


def test_function_key_asked_for_on_401_kept_in_the_tab_and_sent_only_as_a_header(browser, app, upstream):
    """The local host checks no keys, so the first chat request is answered 401 in the browser (as
    the Functions host would, with an empty body); everything else reaches the app."""
    tab = Page(browser, app)
    refused: list[str] = []

    def first_refused(route):
        if not refused:
            refused.append(route.request.url)
            route.fulfill(status=401, body="")
        else:
            route.continue_()

    tab.context.route("**/api/v1/chat/completions", first_refused)
    try:
        tab.open()
        key_field = tab.page.get_by_label("Function key")
        tab.expect(key_field).to_be_hidden()
        tab.ask("[scenario:normal] hi")
        tab.expect(tab.alert).to_have_text(
            "401 Unauthorized. This app needs its function key: enter it under Function key and send again."
        )
        tab.expect(key_field).to_be_visible()
        tab.expect(key_field).to_be_focused()
        key_field.fill("k3y-in-header-only")
        key_field.press("Enter")
        tab.expect(tab.prompt).to_be_focused()
        assert tab.page.evaluate("() => sessionStorage.getItem('chatstream.functionKey')") == "k3y-in-header-only"
        tab.send_button.click()
        tab.expect(tab.answer).to_have_text(TEXTS["normal"])
        tab.wait_ready()
        last = tab.chat_requests()[-1]
        assert last.headers["x-functions-key"] == "k3y-in-header-only"
        models = [r for r in tab.requests if r.url.endswith("/api/v1/models")]
        assert models[-1].headers.get("x-functions-key") == "k3y-in-header-only", "models reloaded with the key"
        assert all("k3y" not in r.url for r in tab.requests), "never in a URL"
        assert upstream.requests(last=1)[0]["json"]["messages"][-1]["content"] == "[scenario:normal] hi"
        tab.page.reload()
        tab.expect(key_field).to_have_value("k3y-in-header-only")  # kept for this tab
        tab.assert_clean(expected_console=r"^Failed to load resource: the server responded with a status of 401")
    finally:
        tab.close()


def test_sse_parser_any_split_any_line_ending(tab):
    """The page's parser, fed the same stream cut at every byte (inside CRLF and inside multi-byte
    characters), with CRLF, CR and LF line endings, comments, multi-line data and event ids."""
    events = tab.page.evaluate("""() => {
        const text = ": keep-alive\\r\\n\\r\\nid: 7\\r\\ndata: {\\"a\\":\\"日本🙂\\"}\\r\\n\\r\\n" +
                     "event: x\\rdata: one\\rid: 8\\rdata: two\\r\\rdata: [DONE]\\n\\n" + "data: incomplete";
        const bytes = new TextEncoder().encode(text);
        const results = new Set();
        for (let cut = 0; cut <= bytes.length; cut++) {
            for (const step of [1, 3, bytes.length]) {
                const parser = new SseParser();
                const out = [...parser.push(bytes.slice(0, cut))];
                for (let i = cut; i < bytes.length; i += step) out.push(...parser.push(bytes.slice(i, i + step)));
                out.push(...parser.end());
                results.add(JSON.stringify(out));
            }
        }
        return [...results];
    }""")
    assert len(events) == 1, events
    assert json.loads(events[0]) == [
        {"event": "message", "data": '{"a":"日本🙂"}', "id": "7"},
        {"event": "x", "data": "one\ntwo", "id": "8"},
        {"event": "message", "data": "[DONE]", "id": ""},  # an event's own id only, never inherited
    ]
    tab.assert_clean()


def test_with_caller_keys_required_the_page_asks_for_one_and_keeps_it_in_this_tab_only(
    browser, upstream, azurite, start_app
):
    app = start_app(AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required")
    created = httpx.post(
        app.url + "/api/manage/callers", json={"name": f"page-{os.getpid()}-{time.time_ns()}"}, timeout=30
    )
    key = created.json()["key"]
    page = Page(browser, app)
    try:
        assert page.page.goto(app.url + "/api/playground").status == 200
        caller_key = page.page.get_by_label("Caller key")
        page.expect(caller_key).to_be_visible()  # the models list answered 401 invalid_api_key
        page.expect(page.page.get_by_label("Function key")).to_be_hidden()
        caller_key.fill(key)
        caller_key.press("Enter")
        page.expect(page.page.get_by_role("combobox", name="Model")).to_have_value("gpt-test")
        page.ask("[scenario:echo] keyed")
        page.expect(page.answer).to_have_text(echo_text("[scenario:echo] keyed"))
        sent = page.chat_requests()[-1].all_headers()
        assert sent["authorization"] == f"Bearer {key}" and "x-functions-key" not in sent
        storage = page.page.evaluate(
            "() => [JSON.stringify(sessionStorage), JSON.stringify(localStorage), document.cookie]"
        )
        assert key in storage[0] and key not in storage[1] and key not in storage[2]
        page.assert_clean(expected_console=r"status of 401")
    finally:
        page.close()


# ------------------------------------------------------------------------------- resumable streams
# An app with RESUMABLE_STREAMS=on on Azurite: the chat answer carries x-stream-id and numbered
# events; the page resumes it after a reload and after a dropped connection, and Stop cancels it.

# Chromium's own console note on a connection the test dropped.
DROPPED = r"^Failed to load resource: net::ERR_(CONNECTION_RESET|INCOMPLETE_CHUNKED_ENCODING|EMPTY_RESPONSE)"


def _watch_answer(tab, until, timeout: float = 15) -> list[str]:
    """Every different text of the Answer until ``until(text)`` is true."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = tab.answer.text_content()
        if not seen or text != seen[-1]:
            seen.append(text)
        if until(text):
            return seen
        time.sleep(0.03)
    raise AssertionError(f"the answer never got there: {seen}")


def _resumes(tab) -> list:
    return [r for r in tab.requests if re.search(r"/api/streams/[A-Za-z0-9_-]{30}$", r.url)]


def _stream_id(tab) -> str:
    response = tab.chat_requests()[-1].response()
    stream_id = response.all_headers().get("x-stream-id")
    assert stream_id and re.fullmatch(r"[A-Za-z0-9_-]{30}", stream_id), response.headers
    return stream_id


def _finished_cleanly(tab, upstream, prompt: str, expected: str) -> None:
    """The answer is exactly the scripted text, the page keeps nothing for a reload, and the upstream
    saw one request for it that ran to its end (no hang-up reached it)."""
    assert tab.answer.text_content() == expected
    assert tab.page.evaluate("() => sessionStorage.getItem('chatstream.stream')") is None
    calls = upstream.calls_for(prompt)
    assert len(calls) == 1, calls
    assert calls[0][1] is not None and calls[0][1]["outcome"] == "completed", calls[0][1]


def test_resumable_a_reload_mid_answer_completes_the_answer_exactly_once(browser, resumable, upstream):
    """Reload while the answer streams: the new page shows the conversation, the question and the text
    so far from sessionStorage, asks streams/ID with Last-Event-ID, and ends with exactly the scripted
    text: every observation a prefix of it, nothing twice. The upstream saw one request, which ran to
    its end. The next turn sends the resumed answer as it was shown."""
    tab = Page(browser, resumable).open()
    try:
        tab.ask("[scenario:normal] an earlier turn")
        tab.expect(tab.answer).to_have_text(TEXTS["normal"])
        tab.wait_ready()
        prompt = f"[scenario:slow_normal] reload me {time.time_ns()}"
        expected = TEXTS["slow_normal"]
        tab.ask(prompt)
        before = _watch_answer(tab, lambda t: len(t) >= len(expected) // 3)
        stream_id = _stream_id(tab)
        assert tab.answer.text_content() != expected, "too late: the answer was complete before the reload"
        kept = tab.page.evaluate("() => JSON.parse(sessionStorage.getItem('chatstream.stream'))")
        assert kept["streamId"] == stream_id and kept["question"] == prompt
        assert expected.startswith(kept["answer"]) and kept["lastEventId"] >= 1

        tab.page.reload()
        tab.expect(tab.page.locator("#question")).to_have_text(prompt)
        after = _watch_answer(tab, lambda t: t == expected)
        tab.wait_ready()
        assert all(expected.startswith(t) for t in before + after), before + after
        assert all(len(a) <= len(b) for a, b in zip(after, after[1:])), after
        _finished_cleanly(tab, upstream, prompt, expected)
        [resume] = _resumes(tab)
        assert resume.method == "GET" and resume.url.endswith(f"/api/streams/{stream_id}")
        assert int(resume.all_headers()["last-event-id"]) >= kept["lastEventId"]
        stats = tab.stats.text_content()
        assert "reconnected 1×" in stats and stats.endswith("finish: stop"), stats
        conversation = tab.page.get_by_role("region", name="Conversation")
        assert TEXTS["normal"] in conversation.text_content(), "the earlier turn is back on screen"

        tab.ask("[scenario:echo] and next?")
        tab.expect(tab.answer).to_have_text(echo_text("[scenario:echo] and next?"))
        tab.wait_ready()
        assert upstream.requests(last=1)[0]["json"]["messages"] == [
            {"role": "user", "content": "[scenario:normal] an earlier turn"},
            {"role": "assistant", "content": TEXTS["normal"]},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": expected},
            {"role": "user", "content": "[scenario:echo] and next?"},
        ]
        tab.assert_clean()
    finally:
        tab.close()


@pytest.mark.parametrize("drops", [1, 3])
def test_resumable_a_dropped_connection_is_resumed_by_the_page(browser, cut, upstream, drops):
    """The proxy resets the page's connection in the middle of the answer (the first cut inside the
    chat completions response, the next ones inside the resumed ones): the page reconnects by itself
    with Last-Event-ID, each time from the last event it showed, and the answer is exact."""
    tab = Page(browser, SimpleNamespace(url=cut.url)).open()
    try:
        cut.cut(b"POST /api/v1/chat/completions ", 900)  # the headers, a first event or two, and a piece
        for _ in range(drops - 1):
            cut.cut(b"GET /api/streams/", 600)
        prompt = f"[scenario:slow_normal] drop me {drops} {time.time_ns()}"
        expected = TEXTS["slow_normal"]
        tab.ask(prompt)
        seen = _watch_answer(tab, lambda t: t == expected)
        tab.wait_ready()
        assert all(expected.startswith(t) for t in seen), seen
        assert len(cut.cut_at) == drops and cut.pending_cuts() == 0
        _finished_cleanly(tab, upstream, prompt, expected)
        resumes = _resumes(tab)
        assert len(resumes) >= drops
        ids = [int(r.all_headers()["last-event-id"]) for r in resumes]
        assert ids == sorted(ids) and ids[0] >= 1, ids
        stats = tab.stats.text_content()
        assert f"reconnected {len(resumes)}×" in stats and stats.endswith("finish: stop"), stats
        tab.expect(tab.page.locator("#answer-note")).to_have_text("")
        tab.assert_clean(expected_console=DROPPED)
    finally:
        tab.close()


def test_resumable_offline_for_a_moment_then_the_page_goes_on(browser, cut, upstream):
    """The browser goes offline (CDP network emulation: it fails new requests but leaves a running
    one alone) and the connection drops (the proxy resets it): the page says it waits, sends nothing
    while offline, and picks the answer up when the browser is online again."""
    tab = Page(browser, SimpleNamespace(url=cut.url)).open()
    try:
        prompt = f"[scenario:slow_normal] offline {time.time_ns()}"
        expected = TEXTS["slow_normal"]
        tab.ask(prompt)
        _watch_answer(tab, lambda t: len(t) >= len(expected) // 4)
        tab.context.set_offline(True)
        assert cut.drop() >= 1
        tab.expect(tab.page.get_by_text("Offline: waiting for the network to reconnect…")).to_be_visible()
        shown = tab.answer.text_content()
        time.sleep(1.0)
        assert _resumes(tab) == [], "no attempt while offline"
        assert tab.answer.text_content() == shown and expected.startswith(shown)
        tab.context.set_offline(False)
        _watch_answer(tab, lambda t: t == expected)
        tab.wait_ready()
        _finished_cleanly(tab, upstream, prompt, expected)
        assert len(_resumes(tab)) == 1
        tab.assert_clean(expected_console=DROPPED)
    finally:
        tab.close()


def test_resumable_stop_cancels_the_stream_and_the_upstream_is_closed(browser, resumable, upstream):
    """Stop no longer just hangs up (that would not stop a resumable stream): it POSTs
    streams/ID/cancel; the app closes the upstream request at once, the stream ends with
    finish_reason "cancelled", the text on screen stays as it was at Stop, marked Stopped."""
    tab = Page(browser, resumable).open()
    try:
        prompt = f"[scenario:slow] stop me {time.time_ns()}"
        tab.ask(prompt)
        _watch_answer(tab, lambda t: len(t.split()) >= 3)
        stream_id = _stream_id(tab)
        clicked = time.time()
        tab.stop_button.click()
        shown = tab.answer.text_content()
        tab.wait_ready()
        tab.expect(tab.page.get_by_text("Stopped.", exact=True)).to_be_visible()
        assert tab.answer.text_content() == shown and TEXTS["slow"].startswith(shown) and shown != TEXTS["slow"]
        assert tab.stats.text_content().endswith("finish: cancelled"), tab.stats.text_content()
        [(request, record)] = upstream.calls_for(prompt)
        assert record["ended_at"] is not None and record["outcome"] == "client_disconnected", record
        assert record["ended_at"] - clicked < 1.5, record["ended_at"] - clicked  # 1 s after the cancel call
        cancels = [r for r in tab.requests if r.url.endswith(f"/api/streams/{stream_id}/cancel")]
        assert [r.method for r in cancels] == ["POST"]
        assert tab.page.evaluate("() => sessionStorage.getItem('chatstream.stream')") is None
        # What the app kept: the stream ends cancelled, then [DONE].
        replay = httpx.get(f"{resumable.url}/api/streams/{stream_id}", timeout=10)
        datas = [line[6:] for line in replay.text.splitlines() if line.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        assert json.loads(datas[-2])["choices"][0]["finish_reason"] == "cancelled", datas[-2:]
        # And the page goes on: the next prompt is answered, with the stopped turn in the conversation.
        tab.ask("[scenario:normal] after the stop")
        tab.expect(tab.answer).to_have_text(TEXTS["normal"])
        tab.wait_ready()
        assert {"role": "assistant", "content": shown} in upstream.requests(last=1)[0]["json"]["messages"]
        tab.assert_clean()
    finally:
        tab.close()


def test_resumable_with_caller_keys_the_resume_and_the_cancel_carry_the_key(browser, upstream, azurite, start_app):
    """With CALLER_KEYS=required, streams/ID and streams/ID/cancel need the stream's own caller key:
    the page sends it with both (and another caller gets 404)."""
    app = start_app(AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required", RESUMABLE_STREAMS="on")
    keys = [
        httpx.post(
            app.url + "/api/manage/callers", json={"name": f"resume-{i}-{os.getpid()}-{time.time_ns()}"}, timeout=30
        ).json()["key"]
        for i in range(2)
    ]
    tab = Page(browser, app)
    try:
        assert tab.page.goto(app.url + "/api/playground").status == 200
        caller_key = tab.page.get_by_label("Caller key")
        caller_key.fill(keys[0])
        caller_key.press("Enter")
        tab.expect(tab.page.get_by_role("combobox", name="Model")).to_have_value("gpt-test")
        prompt = f"[scenario:slow_normal] keyed reload {time.time_ns()}"
        tab.ask(prompt)
        _watch_answer(tab, lambda t: len(t) >= len(TEXTS["slow_normal"]) // 3)
        stream_id = _stream_id(tab)
        assert (
            httpx.get(
                f"{app.url}/api/streams/{stream_id}", headers={"authorization": f"Bearer {keys[1]}"}, timeout=10
            ).status_code
            == 404
        ), "another caller's stream"
        tab.page.reload()
        _watch_answer(tab, lambda t: t == TEXTS["slow_normal"])
        tab.wait_ready()
        [resume] = _resumes(tab)
        assert resume.all_headers()["authorization"] == f"Bearer {keys[0]}"

        tab.ask(f"[scenario:slow] keyed stop {time.time_ns()}")
        _watch_answer(tab, lambda t: len(t.split()) >= 2)
        tab.stop_button.click()
        tab.wait_ready()
        assert tab.stats.text_content().endswith("finish: cancelled"), tab.stats.text_content()
        [cancel] = [r for r in tab.requests if r.url.endswith("/cancel")]
        assert cancel.all_headers()["authorization"] == f"Bearer {keys[0]}"
        tab.assert_clean(expected_console=r"status of 401")
    finally:
        tab.close()


def test_resumable_store_unavailable_and_an_early_replay_show_each_event_once(browser, app):
    """Answers made in the browser (Playwright routes), for what the app does rarely: the first
    response ends with `stream_store_unavailable` (the app could not read its store just then), which
    ends that reading, not the answer, and whose id is not counted; the resumed one starts earlier than
    asked. The page asks again after event 2 and shows every event once."""
    sid = "AZrcT1m3s7Kq2_mZ-0bX9aR4tY1uVw"

    def chunk(n: int, text: str | None, finish: str | None = None) -> str:
        delta = {"content": text} if text is not None else {}
        return (
            f"id: {n}\ndata: "
            + json.dumps(
                {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            )
            + "\n\n"
        )

    unavailable = (
        'id: 3\ndata: {"error": {"message": "the stream\'s store is unavailable", '
        '"type": "stream_store_unavailable", "code": "stream_store_unavailable", "retryable": true}}\n\n'
    )
    first = chunk(1, "one ") + chunk(2, "two ") + unavailable
    resumed = chunk(2, "two ") + chunk(3, "three") + chunk(4, None, "stop") + "id: 5\ndata: [DONE]\n\n"
    tab = Page(browser, app)
    tab.context.route(
        "**/api/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream", "x-stream-id": sid}, body=first
        ),
    )
    tab.context.route(
        f"**/api/streams/{sid}",
        lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=resumed),
    )
    try:
        tab.open()
        tab.ask("[scenario:normal] anything")
        tab.wait_ready()
        assert tab.answer.text_content() == "one two three"
        [resume] = _resumes(tab)
        assert resume.all_headers()["last-event-id"] == "2"
        stats = tab.stats.text_content()
        assert "3 deltas" in stats and "reconnected 1×" in stats and stats.endswith("finish: stop"), stats
        assert tab.page.locator("#error").text_content() == "", "no error shown"
        tab.assert_clean()
    finally:
        tab.close()
