"""Output guard: blocked terms in the model's output are replaced while the text streams.

Operators list terms in ``BLOCKED_TERMS`` (comma-separated, case-sensitive; settings.py splits the
list). Every occurrence in the model's output becomes ``[redacted]``, however the
upstream happens to split the text into deltas.

The definition (what :func:`redact_whole` computes for a whole text)
--------------------------------------------------------------------
Empty terms are ignored and duplicates do not matter. Scan the text left to right from position 0.
At position ``i``:

* if one or more terms start at ``i``, emit the replacement once for the LONGEST of them and continue
  at ``i + len(that term)``;
* otherwise emit ``text[i]`` and continue at ``i + 1``.

So matches never overlap, the leftmost wins, and among terms starting at the same place the longest
wins: terms ``abc``, ``bcd`` on ``abcd`` give ``[redacted]d``; ``ab``, ``abc`` on ``abcx`` give
``[redacted]x``. The replacement is never scanned again (a term ``red`` does not match inside
``[redacted]``). A "character" is a Python code point: matching is exact code-point equality, with
no case folding and no Unicode normalisation (``"é"`` precomposed and ``"e\\u0301"`` are different
texts), and a term may match inside a grapheme cluster (a term ``e`` matches the ``e`` of
``"e\\u0301"``, leaving the combining mark), exactly as the definition says.

Streaming (:class:`Redactor`) and the exact hold-back invariant
---------------------------------------------------------------
Let ``S`` be all text fed since the redactor was made (or last flushed). Run the scan above over ``S``
but stop at the first position ``p`` it reaches where ``S[p:]`` is a *proper prefix* of some term
(a term longer than ``S[p:]`` that starts with ``S[p:]``); ``p = len(S)`` if it reaches none. Then,
after every :meth:`Redactor.feed`:

* everything released so far (the concatenated results of ``feed``) == the scan's output for ``S[:p]``;
* the held-back text is exactly ``S[p:]``, and ``held == len(S) - p``.

Why this is right, and the least that can be held:

* Sound: at every position ``q < p`` the scan reached, ``S[q:]`` is not a proper prefix of any term,
  so no term longer than what is already visible can start at ``q``, whatever comes next; which
  terms start at ``q``, and the longest of them, are already known, and so is every decision before
  ``p``. Hence what is released is a prefix of ``redact_whole(S + C)`` for every continuation ``C``
  (nothing released is ever taken back), and ``"".join(feed(d) for d in deltas) + flush()`` equals
  ``redact_whole("".join(deltas))`` for every split.
* Minimal: at ``p`` the decision is still open. ``S[p:]`` is a proper prefix of some term ``t``: if
  the rest of ``t`` arrives, a term longer than ``S[p:]`` is replaced from ``p`` (swallowing all of
  the held text); if the stream ends, or goes on differently, ``p`` emits ``S[p]`` or replaces a
  term no longer than ``S[p:]``. Everything after ``p`` depends on that decision.

Consequences: ``held <= longest term - 1`` always. The held text is a suffix of ``S`` that is a
proper prefix of a term, so text with no character that begins a term is released at once
(``held == 0``), and a delta that cannot continue the held text or start a term is released in the
same ``feed`` call. The held text can be shorter than the longest suffix of ``S`` that is a proper
prefix of a term, because the scan may already have consumed its start: terms ``abc``, ``cde`` and
``S = "abcd"`` release ``[redacted]d`` and hold nothing (the ``c`` belongs to ``abc``). It can also
hold a complete term: terms ``ab``, ``abcd`` and ``S = "abc"`` hold ``abc`` (``ab`` matches, but
``abcd`` still might); feeding ``x`` then releases ``[redacted]cx``.

Holding is counted in input characters: nothing of the output for ``S[p:]`` is released early, not
even a replacement that every continuation would begin with (after ``ab`` with terms ``ab``,
``abc``, both continuations begin ``[redacted]``), because which input it covers is still open.

Text is held and cut only at code-point boundaries, so the UTF-8 the SSE layer sends for each delta
is always valid. Grapheme clusters may be split across deltas, as the upstream already does; clients
concatenate deltas. A lone surrogate from the upstream passes through like any other code point.

The moderation hook (:class:`ModerationGate`) is a separate building block: it calls an async check
every N released characters and tells its caller when to stop.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable

REPLACEMENT = "[redacted]"

# A trie node is a dict: one-character keys lead to child nodes; the key _END (never a one-character
# string) is present when a term ends at the node. Dicts keep the walk on C-level lookups.
_END = ""
_Node = dict


def _terms(terms: Iterable[str]) -> list[str]:
    if isinstance(terms, str):  # Redactor("secret") would otherwise block "s", "e", "c", ...
        raise TypeError("terms must be an iterable of strings, not a single string")
    unique = []
    for term in terms:
        if not isinstance(term, str):
            raise TypeError(f"a term must be a str, not {type(term).__name__}")
        if term:
            unique.append(term)
    return sorted(set(unique))


def redact_whole(text: str, terms: Iterable[str]) -> str:
    """The definition, on a whole text (see the module docstring). Written to be obviously right,
    not fast: it is the specification the streaming :class:`Redactor` is tested against."""
    candidates = _terms(terms)
    out: list[str] = []
    i = 0
    while i < len(text):
        starting_here = [t for t in candidates if text.startswith(t, i)]
        if starting_here:
            out.append(REPLACEMENT)
            i += max(map(len, starting_here))
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


class Redactor:
    """Streaming redactor for one stream of text: ``feed`` each delta, ``flush`` at the end (what
    each releases: the module docstring). After ``flush`` it is empty and can take a new stream.

    Matching walks a trie of the terms from each scan position that can begin a term; runs of
    characters that cannot begin a term are skipped with one regex search, in C. A ``feed`` costs
    O((held + len(text)) * longest term) in the worst case and about O(held + len(text)) on ordinary
    text, where walks end after a character or two; it never depends on how much text came before.
    A hand-written trie rather than Aho-Corasick (or the pyahocorasick extension): the rule
    "longest term at the leftmost position, then restart after it" plus "stop where the future
    decides" is a plain walk from each scan position, whereas an automaton reports every
    overlapping match and would need the leftmost-longest selection and the hold logic on top.
    """

    __slots__ = ("_held", "_root", "_starts")

    def __init__(self, terms: Iterable[str]) -> None:
        self._root: _Node = {}
        for term in _terms(terms):
            node = self._root
            for ch in term:
                node = node.setdefault(ch, {})
            node[_END] = True
        # Finds the next character that begins some term; None when there are no terms.
        self._starts = (
            re.compile("[" + "".join(map(re.escape, sorted(self._root))) + "]").search if self._root else None
        )
        self._held = ""

    @property
    def held(self) -> int:
        """Number of characters (code points) received but not yet released; ``<= longest - 1``."""
        return len(self._held)

    def feed(self, text: str) -> str:
        """Take the next delta; return the text that can be released now (possibly "")."""
        if self._starts is None:
            return text
        buf = self._held + text if self._held else text
        out, stop = self._scan(buf, final=False)
        self._held = buf[stop:]
        return out

    def flush(self) -> str:
        """The stream has ended: release the held text, redacted; the redactor is empty again."""
        buf, self._held = self._held, ""
        if not buf:
            return ""
        return self._scan(buf, final=True)[0]

    def _scan(self, buf: str, final: bool) -> tuple[str, int]:
        """Run the scan over ``buf`` from 0. Unless ``final``, stop at the first scan position whose
        rest of ``buf`` is a proper prefix of a term. Returns (output, where it stopped)."""
        starts = self._starts
        assert starts is not None, "only called with terms"
        root = self._root
        n = len(buf)
        out: list[str] = []
        q = 0
        while q < n:
            if buf[q] not in root:  # skip the run of characters that cannot begin a term
                found = starts(buf, q)
                if found is None:
                    out.append(buf[q:])
                    q = n
                    break
                out.append(buf[q : found.start()])
                q = found.start()
            # Walk the trie from q: `end` is where the longest term starting at q ends (0 if none).
            node = root
            j = q
            end = 0
            while j < n:
                child = node.get(buf[j])
                if child is None:
                    break
                node = child
                j += 1
                if _END in node:
                    end = j
            if j == n and not final and len(node) > (_END in node):
                # buf[q:] is a proper prefix of a term (the node has children): the next delta
                # decides what happens at q, so hold from q.
                break
            if end:
                out.append(REPLACEMENT)
                q = end
            else:
                out.append(buf[q])
                q += 1
        return "".join(out), q


Verdict = bool | str
"""What a moderation check returns: ``True`` = carry on; ``False`` = stop, "blocked by moderation"; a
string = stop, the string is the reason (an empty string: as ``False``)."""


class ModerationGate:
    """Calls ``check(text_so_far)`` every ``every`` characters of released text and says when to stop.

    ``await gate.push(released)`` after each released piece returns None to carry on, or the reason to
    stop. The check runs when at least ``every`` characters were released since the last check (one
    call per push at most, with all text so far); ``await gate.close()`` at the end checks the
    unchecked rest. Once a check says stop, every later call returns the same reason without calling
    ``check`` again. Exceptions from ``check`` propagate. Awaiting ``push`` before sending the piece
    keeps unchecked text from the client at the cost of the check's latency every ``every``
    characters; that choice is the caller's.
    """

    __slots__ = ("_check", "_checked", "_every", "_parts", "_reason", "_released")

    def __init__(self, check: Callable[[str], Awaitable[Verdict]], every: int) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self._check = check
        self._every = every
        self._parts: list[str] = []
        self._released = 0  # characters released so far
        self._checked = 0  # characters covered by the last check
        self._reason: str | None = None

    async def push(self, released: str) -> str | None:
        """Record released text; run the check if ``every`` characters have built up."""
        if self._reason is None and released:
            self._parts.append(released)
            self._released += len(released)
            if self._released - self._checked >= self._every:
                await self._run()
        return self._reason

    async def close(self) -> str | None:
        """End of the stream: check whatever was released since the last check."""
        if self._reason is None and self._released > self._checked:
            await self._run()
        return self._reason

    async def _run(self) -> None:
        text = "".join(self._parts)
        self._parts = [text]
        self._checked = self._released
        verdict = await self._check(text)
        if verdict is True:
            return
        if verdict is False or verdict == "":
            self._reason = "blocked by moderation"
        elif isinstance(verdict, str):
            self._reason = verdict
        else:
            raise TypeError(f"a moderation check must return bool or str, not {type(verdict).__name__}")
