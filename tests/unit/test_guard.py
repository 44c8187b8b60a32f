"""The output guard (chatstream/guard.py): the streaming redactor against the whole-text definition,
for every split of the text, plus the hold-back invariant and the moderation gate."""

from __future__ import annotations

import asyncio
import re

import pytest
from helpers import examples
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chatstream.guard import REPLACEMENT, ModerationGate, Redactor, redact_whole

# A small alphabet so terms and text collide often, with multi-code-point and non-BMP characters:
# a combining acute accent, a precomposed é, CJK, emoji with a skin-tone modifier, a newline.
SMALL = ["a", "b", "c", " ", "\u0301", "é", "中", "文", "😀", "👍", "🏽", "\n"]
small_text = st.text(alphabet=SMALL, max_size=80)
any_text = st.text(max_size=40)  # the whole of Unicode, lone surrogates included


# ---------------------------------------------------------------------------------------------
# Independent oracles, written differently from chatstream/guard.py on purpose.


def regex_oracle(text: str, terms: list[str], replacement: str = REPLACEMENT) -> str:
    """The definition via ``re``: an alternation tries its branches in order, so with the terms
    longest first the leftmost match is the longest term starting there; re.sub then goes on after
    it, and moves one character on where nothing matches."""
    unique = sorted({t for t in terms if t}, key=len, reverse=True)
    if not unique:
        return text
    return re.sub("|".join(map(re.escape, unique)), lambda _: replacement, text)


def expected_split(seen: str, terms: list[str], replacement: str = REPLACEMENT) -> tuple[str, int]:
    """The hold-back invariant, spelled out: the scan over everything seen, stopped at the first
    position p it reaches where seen[p:] is a proper prefix of some term. Returns (what must have
    been released, p)."""
    unique = [t for t in set(terms) if t]
    out = []
    i = 0
    while i < len(seen):
        rest = seen[i:]
        if any(len(t) > len(rest) and t.startswith(rest) for t in unique):
            break
        hits = [t for t in unique if seen.startswith(t, i)]
        if hits:
            out.append(replacement)
            i += max(len(t) for t in hits)
        else:
            out.append(seen[i])
            i += 1
    return "".join(out), i


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])]  # repeated cuts give empty deltas


# ---------------------------------------------------------------------------------------------
# Strategies: a text, terms that mostly occur in it (plus nested and overlapping ones), a split.


@st.composite
def terms_for(draw, text: str) -> list[str]:
    terms: list[str] = []
    for _ in range(draw(st.integers(0, 7))):
        kind = draw(
            st.sampled_from(["substring", "substring", "random", "longer", "prefix", "suffix", "empty", "duplicate"])
        )
        if kind == "substring" and text:
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 8)))
            terms.append(text[i:j])
        elif kind == "random":
            terms.append(draw(st.text(alphabet=SMALL, min_size=1, max_size=5)))
        elif kind in ("longer", "prefix", "suffix", "duplicate") and terms:
            term = draw(st.sampled_from(terms))
            if kind == "longer":  # nested: the old term is a prefix of the new one
                terms.append(term + draw(st.text(alphabet=SMALL, min_size=1, max_size=4)))
            elif kind == "prefix":  # nested the other way
                terms.append(term[: draw(st.integers(0, len(term)))])
            elif kind == "suffix":  # overlapping: the end of one term begins another
                terms.append(term[draw(st.integers(0, len(term))) :] + draw(st.text(alphabet=SMALL, max_size=3)))
            else:
                terms.append(term)
        elif kind == "empty":
            terms.append("")
    return terms


@st.composite
def streams(draw, texts=st.one_of(small_text, small_text, any_text)):
    text = draw(texts)
    terms = draw(terms_for(text))
    if draw(st.integers(0, 9)) == 0:
        deltas = list(text)  # one character at a time
    else:
        deltas = split_at(text, draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return text, terms, deltas


def longest(terms: list[str]) -> int:
    return max((len(t) for t in terms), default=0)


def proper_prefix_of_a_term(s: str, terms: list[str]) -> bool:
    return any(len(t) > len(s) and t.startswith(s) for t in terms)


# ---------------------------------------------------------------------------------------------
# The main property: the same output for every split, and the invariant after every feed.


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_streaming_equals_whole_text_for_any_split(case):
    text, terms, deltas = case
    whole = redact_whole(text, terms)
    assert whole == regex_oracle(text, terms)

    redactor = Redactor(terms)
    released = ""
    seen = ""
    for delta in deltas:
        out = redactor.feed(delta)
        released += out
        seen += delta

        # Bounded: never more than the longest term minus one character.
        assert redactor.held <= max(longest(terms) - 1, 0)
        # Monotonic: nothing released is taken back.
        assert whole.startswith(released)
        # Exactly the invariant: everything decided is out, the undecided rest is held.
        must_release, stop = expected_split(seen, terms)
        assert released == must_release
        assert redactor.held == len(seen) - stop
        # Weaker consequences, checked directly.
        held_text = seen[len(seen) - redactor.held :]
        if not any(t and t[0] in seen for t in terms):
            assert redactor.held == 0
        if held_text:
            assert proper_prefix_of_a_term(held_text, terms)
            event("held text after a feed")
            if any(held_text.startswith(t) for t in terms if t):
                event("held text that starts with a complete term")

    assert released + redactor.flush() == whole
    if whole != text:
        event("something redacted")
    assert redactor.held == 0


@settings(max_examples=examples(75), deadline=None)
@given(streams(), st.data())
def test_released_text_is_final_whatever_comes_next(case, data):
    """What one feed releases is a prefix of the output for the text so far plus ANY continuation:
    the stream ending here, one that completes a term over the held text, a random one."""
    _, terms, deltas = case
    redactor = Redactor(terms)
    released = seen = ""
    for delta in deltas:
        released += redactor.feed(delta)
        seen += delta
        futures = ["", data.draw(st.text(alphabet=SMALL, max_size=6))]
        held_text = seen[len(seen) - redactor.held :]
        completions = [t[len(held_text) :] for t in terms if held_text and t.startswith(held_text)]
        if completions:
            futures.append(data.draw(st.sampled_from(completions)))
        for future in futures:
            assert redact_whole(seen + future, terms).startswith(released)


@settings(max_examples=examples(100), deadline=None)
@given(st.text(alphabet=SMALL, max_size=60), st.lists(st.integers(0, 60), max_size=10))
def test_no_terms_passes_everything_through_at_once(text, cuts):
    for terms in ([], [""], ["", ""]):
        redactor = Redactor(terms)
        for delta in split_at(text, [c for c in cuts if c <= len(text)]):
            assert redactor.feed(delta) == delta
            assert redactor.held == 0
        assert redactor.flush() == ""


# ---------------------------------------------------------------------------------------------
# Examples.


def stream(terms, deltas):
    redactor = Redactor(terms)
    outs = [redactor.feed(d) for d in deltas]
    return outs, redactor.flush()


def every_split(text):
    """Every split of a short text; for a longer one, every split with at most two cuts and the
    one-character-at-a-time split (2 ** 23 splits would take minutes)."""
    n = len(text)
    if n <= 12:
        for mask in range(2 ** max(n - 1, 0)):
            yield split_at(text, [i + 1 for i in range(n - 1) if mask >> i & 1])
        return
    for a in range(n + 1):
        for b in range(a, n + 1):
            yield split_at(text, [a, b])
    yield list(text)


@pytest.mark.parametrize(
    "terms, text, expected",
    [
        (["abc", "bcd"], "abcd", "[redacted]d"),  # overlapping: the leftmost wins
        (["ab", "abc"], "abcx", "[redacted]x"),  # nested: the longest wins
        (["ab", "abcd"], "abcx", "[redacted]cx"),
        (["ab", "abcd"], "abcd!", "[redacted]!"),
        (["abc", "cde"], "abcde", "[redacted]de"),
        (["aa"], "aaaaa", "[redacted][redacted]a"),
        (["password"], "my password is password1", "my [redacted] is [redacted]1"),
        (["密码"], "你的密码是", "你的[redacted]是"),
        (["😀😀"], "a😀😀😀b", "a[redacted]😀b"),
        (["e"], "cafe\u0301", "caf[redacted]\u0301"),  # code points, not graphemes
        (["é"], "cafe\u0301 café", "cafe\u0301 caf[redacted]"),  # no normalisation
        (["Secret"], "secret Secret", "secret [redacted]"),  # case-sensitive
    ],
)
def test_examples_in_every_split(terms, text, expected):
    assert redact_whole(text, terms) == expected
    for deltas in every_split(text):
        outs, rest = stream(terms, deltas)
        assert "".join(outs) + rest == expected, deltas


def test_undecided_longest_match_is_held_until_the_next_delta():
    redactor = Redactor(["ab", "abcd"])
    assert redactor.feed("abc") == ""
    assert redactor.held == 3  # "ab" matches, but "abcd" still might
    assert redactor.feed("x") == "[redacted]cx"
    assert redactor.held == 0
    assert redactor.flush() == ""


def test_held_text_at_the_end_is_redacted_by_flush():
    redactor = Redactor(["ab", "abcd"])
    assert redactor.feed("zabc") == "z"
    assert redactor.flush() == "[redacted]c"


def test_a_term_split_across_three_deltas():
    redactor = Redactor(["password"])
    assert redactor.feed("my pass") == "my "
    assert redactor.held == 4
    assert redactor.feed("wo") == ""
    assert redactor.held == 6
    assert redactor.feed("rd!") == "[redacted]!"
    assert redactor.held == 0


def test_one_character_at_a_time():
    text = "the passport and the password, pass"
    redactor = Redactor(["password", "pass"])
    outs = []
    for ch in text:
        outs.append(redactor.feed(ch))
        assert redactor.held <= len("password") - 1
    assert "".join(outs) + redactor.flush() == "the [redacted]port and the [redacted], [redacted]"
    assert outs[:4] == ["t", "h", "e", " "]  # released as they come


def test_text_that_cannot_begin_a_term_is_released_at_once():
    redactor = Redactor(["secret", "token"])
    assert redactor.feed("Hello, world! ") == "Hello, world! "
    assert redactor.held == 0
    assert redactor.feed("a se") == "a "  # "se" may begin "secret"
    assert redactor.held == 2
    assert redactor.feed("a") == "sea"  # "sea" cannot
    assert redactor.held == 0


def test_a_consumed_start_is_not_held():
    # "cd" is a proper prefix of "cde", but its "c" already belongs to the "abc" match.
    redactor = Redactor(["abc", "cde"])
    assert redactor.feed("abcd") == "[redacted]d"
    assert redactor.held == 0


def test_a_complete_term_that_a_longer_one_could_extend_is_held():
    redactor = Redactor(["ab", "abc"])
    assert redactor.feed("ab") == ""
    assert redactor.held == 2
    assert redactor.feed("c") == "[redacted]"
    redactor = Redactor(["ab", "abc"])
    assert redactor.feed("ab") == ""
    assert redactor.feed("x") == "[redacted]x"


def test_no_terms_is_a_passthrough():
    redactor = Redactor([])
    for delta in ["Hello", " ", "wörld 😀", ""]:
        assert redactor.feed(delta) == delta
        assert redactor.held == 0
    assert redactor.flush() == ""


def test_empty_and_duplicate_terms():
    outs, rest = stream(["", "ab", "ab", ""], ["xa", "b", "ab"])
    assert "".join(outs) + rest == "x[redacted][redacted]"


def test_the_replacement_is_not_scanned_again():
    assert redact_whole("red alert", ["red"]) == "[redacted] alert"
    outs, rest = stream(["red", "ac"], ["re", "d", " a", "c"])
    assert "".join(outs) + rest == "[redacted] [redacted]"


def test_flush_resets_for_a_new_stream():
    redactor = Redactor(["abc"])
    assert redactor.feed("xab") == "x"
    assert redactor.flush() == "ab"
    assert redactor.held == 0
    assert redactor.feed("c") == "c"  # the old "ab" is gone


def test_a_single_string_is_not_taken_as_a_list_of_terms():
    with pytest.raises(TypeError):
        Redactor("secret")
    with pytest.raises(TypeError):
        Redactor([b"secret"])


# ---------------------------------------------------------------------------------------------
# The moderation gate.


class Recorder:
    def __init__(self, verdicts):
        self.calls: list[str] = []
        self.verdicts = list(verdicts)

    async def __call__(self, text: str):
        self.calls.append(text)
        return self.verdicts.pop(0) if self.verdicts else True


def test_gate_checks_every_n_released_characters():
    async def run():
        check = Recorder([])
        gate = ModerationGate(check, every=5)
        for piece in ["ab", "cd", "e", "", "fghijklmno", "p"]:
            assert await gate.push(piece) is None
        assert check.calls == ["abcde", "abcdefghijklmno"]  # one call per push at most
        assert await gate.close() is None
        assert check.calls[-1] == "abcdefghijklmnop"
        assert await gate.close() is None
        assert len(check.calls) == 3  # nothing new to check

    asyncio.run(run())


@pytest.mark.parametrize(
    "verdict, reason", [(False, "blocked by moderation"), ("", "blocked by moderation"), ("self-harm", "self-harm")]
)
def test_gate_stops_with_a_reason(verdict, reason):
    async def run():
        check = Recorder([True, verdict])
        gate = ModerationGate(check, every=3)
        assert await gate.push("abc") is None
        assert await gate.push("de") is None
        assert await gate.push("f") == reason
        assert await gate.push("ghijkl") == reason  # stays stopped, no more calls
        assert await gate.close() == reason
        assert check.calls == ["abc", "abcdef"]

    asyncio.run(run())


def test_gate_rejects_a_bad_verdict_and_a_bad_interval():
    async def bad(_text):
        return None

    with pytest.raises(ValueError):
        ModerationGate(bad, every=0)
    with pytest.raises(TypeError):
        asyncio.run(ModerationGate(bad, every=1).push("x"))
