"""A caller's request, admitted and charged (``CALLER_KEYS=required``, docs/callers.md).

The endpoint calls this module three times per request::

    caller = await accounting.authenticate(request.headers)    # 401 before the body is read
    admission = await accounting.admit(caller, call, record)   # 404 model / 429 limits / 503 store
    accounting.charge(admission, record, generated)            # when the request is over (background)

``admit`` reserves the prompt's tokens (counted with the model's tokenizer) plus the output cap
(``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens``; ``DEFAULT_MAX_OUTPUT_TOKENS``,
added to the upstream request, when the caller named none) times ``n``. ``charge`` settles it:

- the upstream reported usage (a completed answer): exactly that usage;
- the upstream took the request (answered 200) but the answer ended early (a hang-up, a time limit,
  an upstream failure mid-stream): the counted prompt plus the tokens of the text actually generated
  (before the text steps: what the model produced, not what the caller was shown);
- no upstream took it (refused by us, or an upstream error status before any output): nothing; the
  reservation is released and no ledger row is written.

Every charge is one ledger row. Settling and the ledger write run in the background: the caller's
stream is never held for them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .. import tokens
from ..errors import ErrorKind
from ..pipeline import CallRequest
from ..record import StreamRecord
from .callers import Caller, key_from_headers
from .ledger import Charge, Ledger
from .owners import Owners
from .quota import Quota, Reservation
from .registry import CallerRegistry

log = logging.getLogger("chatstream")

_OVER = frozenset({"completed", "incomplete", "failed", "cancelled"})  # a response's final statuses
_LEDGER_TRIES = 5  # a ledger row the store did not take is written again, 1 s, 2 s, 4 s… later


@dataclass
class Admission:
    """What one admitted request holds: its caller, its reservation and the counted prompt."""

    caller: Caller
    reservation: Reservation
    prompt_tokens: int
    model: str
    created: tuple[str, str] | None = None  # (kind, id) of what the request created, once claimed
    background: bool = False  # a background response: charged when its usage is seen (``charge_seen``)

    @property
    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, for the answer."""
        return self.reservation.headers


def ended(record: StreamRecord) -> str:
    """How a request ended, for its ledger row."""
    if record.disconnected:
        return "disconnected"
    if record.error in (ErrorKind.UPSTREAM_TIMEOUT, ErrorKind.TOTAL_TIMEOUT):
        return "timeout"
    if record.error == "cancelled" or record.finish_reason == "cancelled":
        return "cancelled"
    return "failed" if record.error else "completed"


def _usage_tokens(usage: Mapping | None) -> tuple[int, int] | None:
    """(prompt, completion) from an upstream's usage (chat: prompt/completion_tokens; Responses:
    input/output_tokens); None when it has neither."""
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if type(prompt) is int and type(completion) is int:
        return prompt, completion
    return None


class Accounting:
    def __init__(self, registry: CallerRegistry, quota: Quota, ledger: Ledger, owners: Owners, default_max_output: int):
        self.registry = registry
        self.quota = quota
        self.ledger = ledger
        self.owners = owners
        self.default_max_output = default_max_output
        self._background: set[asyncio.Task] = set()

    async def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request's key (``Authorization: Bearer KEY`` or ``api-key: KEY``); 401."""
        return await self.registry.authenticate(key_from_headers(headers))

    async def admit(self, caller: Caller, call: CallRequest, record: StreamRecord) -> Admission:
        """The caller may use the model, and its limits hold this request: reserved. The output cap is
        added to ``call.params`` when the request named none."""
        model = call.params["model"]
        caller.require_model(model)
        call.params = tokens.with_default_cap(call.params, self.default_max_output)
        prompt = tokens.count_prompt(model, call.params)
        needed = prompt + tokens.choices(call.params) * (tokens.output_cap(call.params) or self.default_max_output)
        reservation = await self.quota.reserve(caller, needed)
        return Admission(caller, reservation, prompt, model)

    def charge(self, admission: Admission | None, record: StreamRecord, generated: list[str] | None) -> None:
        """Settle the admission once the request is over (see the module docstring): in the background."""
        if admission is None:
            return
        task = asyncio.get_running_loop().create_task(self._charge(admission, record, generated))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def claim(self, kind: str, created: str, admission: Admission, background: bool) -> None:
        """What the request created (``response`` ``created``) is its caller's. A background
        response's reservation stays held until its usage is seen (``charge_seen``)."""
        reserved = admission.reservation.tokens if background else 0
        await self.owners.claim(kind, created, admission.caller.name, reserved, admission.reservation.at)
        admission.created, admission.background = (kind, created), background

    async def owned(self, caller: Caller, kind: str, id: str) -> bool:
        """Whether ``kind``/``id`` is ``caller``'s (follow-ups answer 404 to anyone else)."""
        return await self.owners.owner(kind, id) == caller.name

    async def forget(self, kind: str, id: str) -> None:
        await self.owners.forget(kind, id)

    async def charge_seen(self, caller: Caller, kind: str, id: str, body: Mapping, record: StreamRecord) -> None:
        """A stored response read back (a follow-up): when it is over and carries its usage, and nobody
        charged it yet (on any instance), it is charged now: a background response."""
        usage = _usage_tokens(body.get("usage")) if body.get("status") in _OVER else None
        if usage is None or not await self.owners.first_charge(kind, id):
            return
        reserved, at = await self.owners.held(kind, id)
        prompt, completion = usage
        await self.quota.settle_elsewhere(caller, reserved, at, prompt + completion)
        await self.record(
            Charge(
                caller=caller.name,
                model=str(body.get("model") or ""),
                request_id=id,
                endpoint=record.endpoint,
                prompt_tokens=prompt,
                completion_tokens=completion,
                ended="background",
            )
        )

    async def _charge(self, admission: Admission, record: StreamRecord, generated: list[str] | None) -> None:
        reported = _usage_tokens(record.usage)
        if admission.background and admission.created is not None:
            if reported is None:
                return  # it goes on upstream: charged when its usage is seen (charge_seen)
            if not await self.owners.first_charge(*admission.created):
                return  # a follow-up saw it complete first and charged it
        if reported is not None:
            prompt, completion = reported
        elif record.answered:
            prompt = admission.prompt_tokens
            completion = tokens.count_text(admission.model, "".join(generated or ()))
        else:
            await admission.reservation.release()
            return
        await admission.reservation.settle(prompt + completion)
        charge = Charge(
            caller=admission.caller.name,
            model=record.model,
            request_id=record.id,
            upstream_id=record.request_id,
            endpoint=record.endpoint,
            prompt_tokens=prompt,
            completion_tokens=completion,
            ended=ended(record),
        )
        await self.record(charge)

    async def record(self, charge: Charge) -> None:
        """Write ``charge`` to the ledger, again later while the store does not take it."""
        for attempt in range(_LEDGER_TRIES):
            try:
                await self.ledger.record(charge)
                return
            except Exception as exc:  # noqa: BLE001 - logged and retried; a charge must not be lost quietly
                log.warning(
                    "usage ledger: could not record %s's charge (%s); try %d of %d",
                    charge.caller,
                    type(exc).__name__,
                    attempt + 1,
                    _LEDGER_TRIES,
                )
                await asyncio.sleep(2**attempt)
        log.error(
            "usage ledger: %s's charge for request %s (%d tokens) is lost",
            charge.caller,
            charge.request_id,
            charge.total_tokens,
        )

    async def drain(self, within: float = 5.0) -> None:
        """Wait for the charges in flight (tests, shutdown)."""
        deadline = time.monotonic() + within
        while self._background and time.monotonic() < deadline:
            await asyncio.wait(list(self._background), timeout=max(0.0, deadline - time.monotonic()))
