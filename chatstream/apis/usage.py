"""A request as the shared state is told of it (state/port.py), in its words: the ``AdmissionRequest``
a call makes (its prompt counted, its output cap, the context it refers to) and the ``Usage`` of a
finished one (each segment's usage as the upstream reported it, chat completions' or Responses' field
names, or else its prompt as sent and its generated text counted; how it ended). The state never
reads a request body, a usage object or an error code: this module does, for every route."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from .. import tokens
from ..errors import ErrorKind
from ..pipeline import CallRequest
from ..record import StreamRecord
from ..state.port import AdmissionRequest, Ended, Usage, Used


def admission_request(call: CallRequest, record: StreamRecord, default_max: int) -> AdmissionRequest:
    """What ``call`` asks the state to hold. The default output cap is added to ``call.params`` when
    the request named none (``DEFAULT_MAX_OUTPUT_TOKENS``), so that what is reserved bounds what the
    upstream may generate."""
    call.params = tokens.with_default_cap(call.params, default_max)
    params = call.params
    model = params["model"]
    previous = params.get("previous_response_id")
    return AdmissionRequest(
        request_id=record.id,
        endpoint=record.endpoint,
        model=model,
        prompt_tokens=tokens.count_prompt(model, params),
        output_tokens=tokens.choices(params) * (tokens.output_cap(params) or default_max),
        previous=previous if isinstance(previous, str) and previous else None,
        references=bool(params.get("conversation")) or _references_items(params.get("input")),
    )


def _references_items(items: object) -> bool:
    return isinstance(items, list) and any(isinstance(i, Mapping) and i.get("type") == "item_reference" for i in items)


def usage_of(usage: Mapping | None) -> Used | None:
    """An upstream's usage (chat: prompt/completion_tokens, prompt_tokens_details.cached_tokens;
    Responses: input/output_tokens, input_tokens_details.cached_tokens); None when it has neither."""
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if type(prompt) is not int or type(completion) is not int:
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    cached = cached if type(cached) is int and 0 <= cached <= prompt else 0
    return Used(prompt, cached, completion)


def ended(record: StreamRecord) -> Ended:
    """How a request ended, for its ledger row. A hang-up and a time limit can race: whichever the
    request saw first is what it records (a caller gone before the limit fired is ``disconnected``)."""
    if record.disconnected:
        return "disconnected"
    if record.error in (ErrorKind.UPSTREAM_TIMEOUT, ErrorKind.TOTAL_TIMEOUT):
        return "timeout"
    if record.error == "cancelled" or record.finish_reason == "cancelled":
        return "cancelled"
    return "failed" if record.error else "completed"


def request_usage(
    model: str,
    prompt_tokens: int,
    record: StreamRecord,
    generated: Mapping[int, Sequence[str]] | None,
) -> Usage:
    """What the request for ``model``, its prompt counted as ``prompt_tokens``, used: each segment's
    reported usage; else, when its upstream took it, its prompt as sent (a continuation's carries the
    text before it and the instruction to go on, ``Segment.prompt_tokens``) and the tokens it
    generated (``generated``: each choice's text, before the text steps); a non-streamed call
    abandoned in flight, its prompt (the upstream has read it); nothing when no upstream took it."""
    reported = usage_of(record.usage)
    if record.segments:
        used = []
        for segment in record.segments:
            found = usage_of(segment.usage)
            if found is None:
                prompt = segment.prompt_tokens if segment.prompt_tokens is not None else prompt_tokens
                found = Used(prompt, 0, tokens.count_text(model, segment.text))
            served = _served(model, segment.model)
            used.append(replace(found, upstream=segment.upstream, request_id=segment.request_id, model=served))
    else:
        served = _served(model, record.upstream_model)
        if reported is not None:
            used = [Used(reported.prompt, reported.cached, reported.completion, record.upstream, model=served)]
        elif record.answered:
            completion = sum(tokens.count_text(model, "".join(parts)) for parts in (generated or {}).values())
            used = [Used(prompt_tokens, 0, completion, record.upstream, model=served)]
        elif record.prompt_only:
            used = [Used(prompt_tokens, 0, 0, record.upstream, model=served)]
        else:
            used = []
    return Usage(tuple(used), ended(record), reported is not None, record.request_id or None)


def _served(model: str, sent: str | None) -> str | None:
    """The model name an upstream was sent, when it is not the requested one."""
    return sent if sent and sent != model else None
