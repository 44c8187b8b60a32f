"""chatstream/state/store_azure.py reading a $batch's answer (``_batch_answer``): over answers
recorded from Azurite (store_batch_answers.json: a 1-row and a 50-row insert, four mixed
operations, a 409 at operation 3, a 412 at operation 7, a 404 at operation 0), a success, or the
failing operation's status, code and index; and, whatever the boundaries and line ends, the same
outcome as the stdlib ``email`` parser's reading of the multipart gives (``by_email``, what the
store did before)."""

from __future__ import annotations

import contextlib
import email
import email.policy
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from helpers import examples
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chatstream.errors import AlreadyExists, Modified, NotFound
from chatstream.state.store_azure import ErrorAnswer, _batch_answer, store_error

ANSWERS = json.loads((Path(__file__).parent / "store_batch_answers.json").read_text())


def recorded(name: str, lf: bool = False) -> tuple[int, dict[str, str], bytes]:
    answer = ANSWERS[name]
    body = answer["body"].encode("latin-1")
    return answer["count"], {"Content-Type": answer["content_type"]}, body.replace(b"\r\n", b"\n") if lf else body


def by_email(headers: Mapping[str, str], data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP answers in a multipart body as the stdlib ``email`` parser splits them (what
    store_azure.py used before): status, headers with lower-case names, body."""
    content = f"Content-Type: {headers.get('Content-Type', '')}\r\n\r\n".encode() + data
    found: list[tuple[int, dict[str, str], bytes]] = []
    for part in email.message_from_bytes(content, policy=email.policy.compat32).walk():
        if part.get_content_type() != "application/http":
            continue
        payload = part.get_payload(decode=True)
        text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else str(part.get_payload())
        head, _, body = text.replace("\r\n", "\n").partition("\n\n")
        lines = head.split("\n")
        fields = (line.split(":", 1) for line in lines[1:] if ":" in line)
        found.append((int(lines[0].split(" ", 2)[1]), {k.strip().lower(): v.strip() for k, v in fields}, body.encode()))
    return found


def outcome(count: int, headers: Mapping[str, str], data: bytes) -> tuple[int, str | None, int | None] | None:
    """What ``_batch_answer`` says of a batch: None (a success), or its error's status, code, index."""
    try:
        _batch_answer(count, data)
    except ErrorAnswer as refused:
        return refused.status, refused.code, refused.index
    return None


def email_outcome(count: int, headers: Mapping[str, str], data: bytes) -> tuple[int, str | None, int] | None:
    """What the email parser's parts say of a batch: its first failed operation's status, code and
    index (the odata.error's message starts with it; 0 when it does not say), or None."""
    parts = by_email(headers, data)
    for status, _, body in parts:
        if status >= 300:
            error: dict = {}
            with contextlib.suppress(ValueError):
                error = json.loads(body).get("odata.error") or {} if body.strip() else {}
            said = str((error.get("message") or {}).get("value", "")).split(":", 1)[0]
            return status, error.get("code") or None, int(said) if said.isdigit() else 0
    return None if len(parts) == count else (0, None, 0)


@pytest.mark.parametrize("lf", [False, True], ids=["crlf", "lf"])
def test_a_successful_answer_reads_as_one_of_each_operation(lf):
    for name in ("ok1", "ok50", "mixed4"):
        count, headers, body = recorded(name, lf)
        _batch_answer(count, body)
        assert outcome(count + 1, headers, body) == (0, None, 0)  # one short
    assert all(outcome(*recorded(name, lf)) == email_outcome(*recorded(name, lf)) for name in ANSWERS)


@pytest.mark.parametrize(
    ("name", "status", "code", "index", "error"),
    [
        ("fail409", 409, "EntityAlreadyExists", 3, AlreadyExists),
        ("fail412", 412, "UpdateConditionNotSatisfied", 7, Modified),
        ("fail404", 404, "ResourceNotFound", 0, NotFound),
    ],
)
@pytest.mark.parametrize("lf", [False, True], ids=["crlf", "lf"])
def test_a_refused_batch_names_the_failing_operation(name, status, code, index, error, lf):
    with pytest.raises(ErrorAnswer) as refused:
        _batch_answer(*recorded(name, lf)[::2])
    assert (refused.value.status, refused.value.code, refused.value.index) == (status, code, index)
    mapped = store_error(refused.value, "batch")
    assert isinstance(mapped, error) and getattr(mapped, "index", None) == index


def test_an_error_without_a_body_is_refused():
    count, headers, body = recorded("ok1")
    bare = body.replace(b"HTTP/1.1 204 No Content", b"HTTP/1.1 500 Internal Server Error")
    with pytest.raises(ErrorAnswer) as failed:
        _batch_answer(count, bare)
    assert (failed.value.status, failed.value.code, failed.value.index) == (500, None, 0)


# --- any boundary, any line ends: what the email parser reads ----------------------------------

# RFC 2046's boundary characters, but the space (not last): quoted when not a token's.
BOUNDARY = st.text(alphabet="0123456789abcXYZ'()+_,-./:=?", min_size=1, max_size=70)
TOKEN = set("0123456789abcXYZ'+_-.")
TEXT = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@st.composite
def answers(draw: st.DrawFn) -> tuple[int, dict[str, str], bytes, str]:
    """A $batch answer as the Table service writes one: a changeset of HTTP answers (successes,
    then maybe one error with or without a JSON body naming the index), every line ended by CRLF,
    by LF or by either at random, the boundaries quoted or not."""
    batch, changeset = draw(BOUNDARY), draw(BOUNDARY)
    relation = draw(st.sampled_from(["apart", "longer", "shorter"]))  # a line that starts as one's delimiter
    if relation != "apart":
        batch, changeset = (batch, batch + changeset) if relation == "longer" else (changeset + batch, changeset)
    batch, changeset = batch[:70], changeset[:70]
    assume(batch != changeset)
    style = draw(st.sampled_from(["\r\n", "\n", "either"]))
    ends = st.sampled_from(["\r\n", "\n"]) if style == "either" else st.just(style)

    def lines(*texts: str) -> str:
        return "".join(text + draw(ends) for text in texts)

    def boundary(value: str) -> str:
        return f'"{value}"' if draw(st.booleans()) or not set(value) <= TOKEN else value

    count = draw(st.integers(1, 8))
    parts: list[str] = []
    for index in range(count):
        head = lines("Content-Type: application/http", "Content-Transfer-Encoding: binary", "")
        etag = draw(st.none() | TEXT)
        if index < count - 1 or draw(st.booleans()):
            fields = ["Cache-Control: no-cache"] + ([] if etag is None else [f"ETag: {etag.strip()}"])
            parts.append(head + lines(f"HTTP/1.1 {draw(st.sampled_from([201, 204]))} OK", *fields, ""))
            continue
        status = draw(st.sampled_from([400, 404, 409, 412, 500, 503]))
        said = draw(st.sampled_from(["", f"{index}:", "x:"])) + draw(TEXT)
        error = {"code": draw(TEXT), "message": {"lang": "en-US", "value": said}}
        said_as = [
            json.dumps({"odata.error": error}),
            json.dumps({"odata.error": error}, indent=1),
        ]  # one line, or many
        body = draw(st.sampled_from(["", *said_as, "not json"]))
        fields = ["Content-ID: 1"] + (["Content-Type: application/json"] if body else [])
        parts.append(head + lines(f"HTTP/1.1 {status} Failed", *fields, "") + body)
    text = lines(f"--{batch}", f"Content-Type: multipart/mixed; boundary={boundary(changeset)}", "")
    for part in parts:  # each delimiter on a line of its own (the line end before it is its own)
        text += f"--{changeset}" + draw(ends) + part + draw(ends)
    text += lines(f"--{changeset}--", f"--{batch}--")
    assume(all(f"--{value}" not in part for part in parts for value in (batch, changeset)))
    return count, {"Content-Type": f"multipart/mixed; boundary={boundary(batch)}"}, text.encode(), batch


@settings(max_examples=examples(100), deadline=None)
@given(answer=answers())
def test_any_answer_reads_as_the_email_parser_reads_it(answer):
    count, headers, body, _ = answer
    assert outcome(count, headers, body) == email_outcome(count, headers, body)
