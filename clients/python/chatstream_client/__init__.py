"""Resume a chatstream app's resumable streams after a cut, under an unchanged SDK:

    client = OpenAI(base_url=..., http_client=httpx.Client(transport=ResumingTransport()))
    client = AsyncOpenAI(base_url=..., http_client=httpx.AsyncClient(transport=AsyncResumingTransport()))

The rules (where it reconnects, what it retries, the bound): resumption.py and docs/resumable.md."""

from .resumption import Backoff, streams_url_for
from .splice import Splice
from .transport import AsyncResumingTransport, ResumingTransport

__all__ = ["AsyncResumingTransport", "Backoff", "ResumingTransport", "Splice", "streams_url_for"]
