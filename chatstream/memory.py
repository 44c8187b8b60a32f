"""The worker's memory: big answers' goes back to the operating system once they are over, as do the
pages of data read once; start-up's objects are kept out of the garbage collector's walks.

A non-streamed answer of a few MB, or a long stream, is many allocations that Python hands back to
the C allocator when the answer ends (or when its caller hangs up), but glibc's ``malloc`` keeps
most of the freed memory in the process: it gives back only a free stretch at the top of its heap,
and the pieces of a big answer are spread between objects that live on. Measured through the local
host: eight callers who hung up on 4.9 MB answers left the worker 14 MB (non-streamed) to 34 MB
(streamed) bigger for good; ``malloc_trim`` gives it back.

``released(nbytes)`` is told by the responses (``http.py``) how much an answer that just ended
wrote; once answers since the last trim add up to ``TRIM_AFTER_BYTES``, ``malloc_trim(0)`` runs
``TRIM_DELAY_SECONDS`` later (long enough for the request's objects to be gone; the answers that
end meanwhile share it). Small answers alone trigger it rarely (one per ~4 MB written). Where the C
library has no ``malloc_trim`` (musl, macOS) nothing is done.

``drop_read_pages(path)`` gives back the pages of a library's data that were read once: bpe-openai's
tokenizer tables are compiled into its extension's read-only data (about 32 MB for o200k_base, all
of it read when the tokenizer is built from it, never again), and would stay in the process's
resident memory as clean file pages until the kernel runs short (tokens.py calls it after each
build; measured: the keyed worker 187 -> 155 MB). Only mappings that
can hold no private copy of a page are dropped (read-only, not code, no anonymous page: not the
library's relocated data), so a page read again is read back from the file, never lost. They stay
in the page cache, unmapped: the first memory the kernel reclaims, and a page the extension reads
again (a constant) costs no disk read. Linux only; elsewhere nothing is done.

``started()``, at the end of start-up (function_app.py): what start-up made (modules, settings,
clients: ~125,000 objects) is frozen (``gc.freeze``; not collected first: start-up leaves ~20
objects of garbage, and a collection would add ~65 ms to the cold start). The collector's full
collections, which the worker ran every few 100-stream waves, walked all of it: 33-85 ms of CPU
each here, every stream of the worker waiting through it (the tail of the time to first delta,
issue #44). Frozen, they walk only what came after. Frozen objects are still freed when their last
reference goes; only a reference cycle among them would stay. Young collections then run every
10,000 allocations, not 2,000: with 300 requests at once, every 2,000 allocations found most of
the requests' state alive and walked it again (one in ten of them a middle collection, 8 ms each);
spaced out, more of it is freed first (300 at once, in-process: the collector's CPU -26 to -49%).
Middle collections run every 50 young ones, not 10: each walked every live request's state again
(8-34 ms, all 300 streams waiting). 300 at once, in-process (tools/bench/burst.py, before and after
alternating, two sessions of 3-4 runs each): the collector's longest pause 18-37 -> 6-13 ms, its CPU
in the bursts -14% and -40% (medians); added time to first delta p99 0.82x and 1.04x (not resolved);
peak RSS +5 MB (cycles wait longer to be collected)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import re
import time
from collections.abc import Callable

log = logging.getLogger("chatstream")

TRIM_AFTER_BYTES = 4 * 1024 * 1024
YOUNG_COLLECTION = 10_000  # allocations between the collector's young collections (Python's: 2,000)
MIDDLE_COLLECTION = 50  # young collections between its middle ones (Python's: 10)
TRIM_DELAY_SECONDS = 0.5
MADV_DONTNEED = 4  # Linux's madvise(2) advice: drop the range's pages (a file mapping's are read again)


def _libc(name: str, argtypes: list[type], use_errno: bool = False) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning an int), or None where it has none."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=use_errno), name)  # the process's own C library
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


class Trimmer:
    """Counts what answers wrote and trims the C heap after enough of it (one per process)."""

    def __init__(
        self, trim: Callable[[int], int] | None, after: int = TRIM_AFTER_BYTES, delay: float = TRIM_DELAY_SECONDS
    ):
        self._trim = trim
        self.after = after
        self.delay = delay
        self.pending = 0  # bytes written by answers that ended since the last trim
        self._scheduled: asyncio.TimerHandle | None = None

    def released(self, nbytes: int) -> None:
        """An answer that wrote ``nbytes`` is over (written, or its caller gone)."""
        if self._trim is None:
            return
        self.pending += nbytes
        if self.pending < self.after or self._scheduled is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a test's direct call): at once
            self.trim()
            return
        self._scheduled = loop.call_later(self.delay, self.trim)

    def trim(self) -> None:
        """Give the C heap's free memory back now (also after a one-off build whose temporaries were
        freed: tokens.py's tables)."""
        self._scheduled = None
        self.pending = 0
        if self._trim is None:
            return
        started = time.perf_counter()
        self._trim(0)
        log.debug("malloc_trim took %.1f ms", (time.perf_counter() - started) * 1000)


_trimmer = Trimmer(_libc("malloc_trim", [ctypes.c_size_t]))
released, trim = _trimmer.released, _trimmer.trim


def _read_only_mappings(path: str) -> list[tuple[int, int, int, int]]:
    """This process's mappings of ``path`` that may be dropped (module docstring), from
    /proc/self/smaps: (start, end, file offset, resident kB) each."""
    with open("/proc/self/smaps", errors="surrogateescape") as smaps:  # file names as os.path gives them
        text = smaps.read()
    # A mapping: its first line (range, permissions, offset, device, inode, path), then "Field: value" lines.
    mapping = re.compile(
        rf"^([0-9a-f]+)-([0-9a-f]+) r--p ([0-9a-f]+) \S+ \d+ +{re.escape(path)}\n((?:[A-Za-z_]+:.*\n)*)", re.M
    )
    found = []
    for match in mapping.finditer(text):
        fields = dict(re.findall(r"^(Rss|Anonymous): +(\d+)", match[4], re.M))
        if fields.get("Anonymous") == "0":
            found.append((int(match[1], 16), int(match[2], 16), int(match[3], 16), int(fields.get("Rss", 0))))
    return found


def drop_read_pages(path: str) -> int:
    """Give back the resident pages of ``path``'s read-only data (module docstring); the kB dropped."""
    madvise = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], use_errno=True)
    if madvise is None or not os.path.exists("/proc/self/smaps"):
        return 0
    path = os.path.realpath(path)
    dropped = 0
    try:
        for start, end, _offset, rss in _read_only_mappings(path):
            if madvise(start, end - start, MADV_DONTNEED) == 0:
                dropped += rss
    except (OSError, ValueError) as exc:  # nothing is lost: the pages stay
        log.warning("could not drop %s's pages: %s", path, exc)
    log.debug("dropped %d kB of %s's pages", dropped, path)
    return dropped


def started() -> None:
    """Start-up is over: its objects are frozen, collections spaced out (module docstring)."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION, MIDDLE_COLLECTION, gc.get_threshold()[2])
