"""Resumable streams' storage (docs/resumable.md): a stream's SSE events numbered, kept in the shared
store, replayed on any instance, followed live, cancelled from any instance, taken over by another
instance when its producer dies or drains, and deleted after their TTL. The request path drives it
through ``StreamLog`` (log.py, with its contract).

One module per concept, each one's docstring saying more: format.py, what is stored and what names
it; producer.py, a stream produced here (``Producer``); readers.py, following a stream from here or
from the store (``Reader``); inbox.py, what a reader tells a producing instance (a cancel, its
registration); takeover.py, one winner for a stream whose producer is gone (``Claim``); config.py, the
tuning and what the parts share; errors.py, the domain errors. Liveness is ``Instances``
(state/instances.py): one heartbeat row per instance, nothing per stream; every time that crosses
instances is the store's clock; sweeps run on the duty holder (``Instances.every``)."""
