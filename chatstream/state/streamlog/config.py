"""The tuning of resumable streams (``ResumeConfig``): the two settings (RESUME_ABANDON_SECONDS,
RESUME_TTL_SECONDS), the producer's cap from TOTAL_TIMEOUT_SECONDS, and the cadences and limits
docs/resumable.md measured with these defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResumeConfig:
    abandon_seconds: float = 30.0  # RESUME_ABANDON_SECONDS
    ttl_seconds: float = 600.0  # RESUME_TTL_SECONDS
    # A producer not finished this long after it started is ended here (stream_lost) and asked to
    # stop: set it above the relay's own total limit.
    max_stream_seconds: float = 660.0
    fast_flush_seconds: float = 0.1  # a reader on another instance follows: one write per 100 ms at most
    checkpoint_seconds: float = 5.0  # nobody elsewhere follows: one write per 5 s at most
    flush_bytes: int = 512 * 1024  # ...or as soon as this much waits
    max_stream_bytes: int = 16 * 1024 * 1024  # kept (memory, blob) per stream; beyond it: not resumable
    # A remote reader polls the blob every poll_seconds after new bytes (about the producer's write
    # cadence, so it locks onto it), a third of that after an empty read while bytes flow (so a
    # write that lands just after a poll waits ~33 ms, not 100), then slower to max_poll_seconds.
    poll_seconds: float = 0.1
    max_poll_seconds: float = 0.5
    # Many streams followed at once: the instance's fast writes and remote polls are spread so that
    # together they stay under write_rate and read_rate calls a second (each stream's interval grows
    # with their number). A busy instance then answers later instead of timing out on its own CPU:
    # a store call costs ~1-2 ms of it (docs/resumable.md), 1,000 fast writes a second would be 2 cores.
    write_rate: float = 100.0
    read_rate: float = 200.0
    # ...and at most this many of those writes and polls are in flight at once: when the store is
    # slow they wait here, in turn, not in its queue where the heartbeat, the inbox and the
    # resume routes' calls would wait behind them and time out (a lost heartbeat reads as a dead
    # producer elsewhere). On Azure Storage (a few ms a call) 16 allow a few thousand calls a second.
    bulk_calls: int = 16
    young_poll_seconds: float = 0.2  # a reader elsewhere polls for the record of a stream just started
    state_seconds: float = 1.0  # a remote reader checks the producer's lease this often
    inbox_seconds: float = 0.5  # a producing instance reads its inbox (cancels, remote readers) this often
    heartbeat_seconds: float = 1.5
    lease_seconds: float = 4.5  # a producing instance whose heartbeat is older is dead
    give_up_seconds: float = 10.0  # the store failing this long: a producer stops storing, a reader ends
    # Last-Event-ID past what is stored of a live stream elsewhere: wait at most this long for the
    # producer to store it, or for its heartbeat to prove the id was never handed out (two beats).
    past_end_wait_seconds: float = 5.0
    max_readers: int = 256  # readers this instance serves at once
    max_readers_per_stream: int = 16
    max_producers: int = 1000
    max_sweep: int = 1000  # rows one sweep deletes at most
    sweep_every: float | None = None  # seconds between sweeps; None: from the TTL (sweep_seconds)

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> ResumeConfig:
        """From the app's Settings: RESUME_ABANDON_SECONDS, RESUME_TTL_SECONDS, TOTAL_TIMEOUT_SECONDS."""
        return cls(
            abandon_seconds=settings.resume_abandon_seconds,
            ttl_seconds=settings.resume_ttl_seconds,
            max_stream_seconds=settings.total_timeout + 60.0,
            **overrides,
        )

    @property
    def read_refresh_seconds(self) -> float:
        """How often a remote reader says it is still reading."""
        return max(0.2, min(5.0, self.abandon_seconds / 3))

    @property
    def reader_row_seconds(self) -> float:
        """How long a remote reader's inbox row outlives its last write: a few refreshes, and no
        longer than the TTL needs (rows are gone a TTL after their streams), the producer reading
        it within inbox_seconds."""
        return min(2 * self.abandon_seconds + 60.0, max(self.ttl_seconds, 3 * self.read_refresh_seconds + 5.0))

    @property
    def read_fresh_seconds(self) -> float:
        """A reader's ``read_at`` younger than this means it is following (fast writes)."""
        return 2 * self.read_refresh_seconds + 1.0

    @property
    def sweep_seconds(self) -> float:
        """A quarter of the TTL, within 1 s..5 min: a stream is deleted at most 25% after its TTL."""
        if self.sweep_every is not None:
            return self.sweep_every
        return max(1.0, min(300.0, self.ttl_seconds / 4))
