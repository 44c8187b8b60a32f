"""How much of a limit an instance takes from its counter row, and how much it keeps idle: the
policy of the leases in counters.py (pure functions of what the row and the lease say, and a
lone request's ``Hold``).

An exchange grants the waiting reservations that fit under the limit, in order (a large one does
not block smaller ones behind it). A lone request takes one more request's worth for the next one,
kept ``HOLD_SECONDS`` from the last request it served, so that requests at a steady pace need no
exchange before their upstream call; what it spends of that hold is taken again after the request.
What every instance keeps idle together (each row entry says what it keeps) stays under
``HOLD_SHARE`` of the limit, however many instances there are."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HOLD_SECONDS = 3.0  # a lone request's hold outlives a pause of a few seconds between requests
HOLD_SHARE = 0.1


class Hold:
    """A lone request's hold on one counter: the ``share`` it may keep idle, until when, and whether
    a request served from it settled since (``top_up``: take that again). ``over`` is called when a
    hold ends."""

    def __init__(self, over: Callable[[], None]):
        self.share = 0
        self.until = 0.0
        self.top_up = False
        self._over = over
        self._timer: asyncio.TimerHandle | None = None

    def active(self) -> bool:
        return asyncio.get_running_loop().time() < self.until

    def serving(self) -> bool:
        """Whether a request now is served from the hold."""
        return bool(self.share) and self.active()

    def renew(self) -> None:
        """The hold lasts ``HOLD_SECONDS`` from now."""
        loop = asyncio.get_running_loop()
        self.until = loop.time() + HOLD_SECONDS
        if self._timer is None:
            self._timer = loop.call_later(HOLD_SECONDS + 0.01, self._check)

    def end(self) -> None:
        self.until = 0.0

    def _check(self) -> None:
        self._timer = None
        left = self.until - asyncio.get_running_loop().time()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left + 0.01, self._check)
        else:
            self._over()


def fitting(needs: Sequence[int], room: int) -> tuple[list[int], int]:
    """The indexes of the ``needs`` that fit in ``room`` taken in order, and their total."""
    chosen: list[int] = []
    total = 0
    for i, need in enumerate(needs):
        if total + need <= room:
            chosen.append(i)
            total += need
    return chosen, total


@dataclass(frozen=True)
class Keep:
    """What the instance keeps after an exchange: ``balance`` unassigned, and its hold share (None:
    unchanged)."""

    balance: int
    hold_share: int | None = None


def to_keep(
    *,
    limit: int,
    room: int,
    granted: int,
    balance: int,
    hold_share: int,
    others_idle: int,
    holding: bool,
    top_up: bool,
    waiting: bool,
    lone: int | None,
) -> Keep:
    """``room``: what the limit leaves plus this instance's ``balance``; ``granted``: what the
    exchange grants the waiting reservations; ``holding``: within a hold; ``top_up``: a request
    served from the hold settled since; ``lone``: the need of a lone minute request granted now."""
    # While holding, at most this instance's share stays idle here (what came back beyond it goes).
    keep = min(balance, hold_share) if holding and not waiting else 0
    share = max(0, int(limit * HOLD_SHARE) - others_idle)
    if top_up and holding and not waiting:
        # The hold back to its size, so far as the limit and the other instances' idle shares allow.
        keep = max(keep, min(hold_share, share, room))
    if lone is None:
        return Keep(keep)
    extra = max(0, min(lone, share, room - granted))  # a lone request: one more for the next
    return Keep(max(keep, extra), extra)
