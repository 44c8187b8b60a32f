"""chatstream/pipeline.py in process: before-steps (sync or async, rejections, failures named), the
text filter chain with its flush and the moderation gate, after-steps in the background, and the
built-in steps (what ``prompt_chars`` counts, where ``system_prompt`` goes)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from chatstream.errors import ApiError, ModerationStop, Rejection, StepFailed
from chatstream.guard import Redactor
from chatstream.pipeline import CallRequest, Pipeline, max_prompt_chars, prompt_chars, system_prompt
from chatstream.record import StreamRecord
from chatstream.settings import Settings


def call(**params) -> CallRequest:
    return CallRequest(
        params={"model": "m", "messages": [{"role": "user", "content": "hi"}], **params}, endpoint="openai"
    )


# -------------------------------------------------------------------------------- before-steps


async def test_before_steps_sync_and_async_run_in_order():
    pipeline = Pipeline()
    seen = []

    @pipeline.before
    def first(c: CallRequest) -> None:
        seen.append("first")
        c.params["user"] = "web"

    @pipeline.before
    async def second(c: CallRequest) -> None:
        await asyncio.sleep(0)
        seen.append(("second", c.params["user"]))
        c.params["model"] = "chosen"

    assert first.__name__ == "first", "the decorator returns the step"
    c = call()
    await pipeline.run_before(c)
    assert seen == ["first", ("second", "web")]
    assert c.params["model"] == "chosen"


async def test_a_rejection_passes_as_it_is_and_stops_the_steps():
    pipeline = Pipeline()
    after = []
    rejection = Rejection(422, "refused by policy", "policy")
    pipeline.before(lambda c: (_ for _ in ()).throw(rejection))
    pipeline.before(lambda c: after.append(1))
    with pytest.raises(Rejection) as info:
        await pipeline.run_before(call())
    assert info.value is rejection and after == []


async def test_any_api_error_from_a_step_passes():
    pipeline = Pipeline()
    error = ApiError(429, "quota", "too many requests today", retryable=True)

    @pipeline.before
    async def quota(c):
        raise error

    with pytest.raises(ApiError) as info:
        await pipeline.run_before(call())
    assert info.value is error


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_raising_before_step_is_step_failed_with_its_name_and_logged(asynchronous, caplog):
    pipeline = Pipeline()
    if asynchronous:

        async def tag_user(c):
            raise KeyError("user")
    else:

        def tag_user(c):
            raise KeyError("user")

    pipeline.before(tag_user)
    with caplog.at_level(logging.ERROR, logger="chatstream"), pytest.raises(StepFailed) as info:
        await pipeline.run_before(call())
    error = info.value
    assert error.step.endswith("tag_user") and "tag_user" in error.message
    assert (error.status, error.type) == (500, "pipeline_error")
    assert error.__cause__ is None and error.__suppress_context__
    [entry] = [r for r in caplog.records if "before-step" in r.getMessage()]
    assert "tag_user" in entry.getMessage() and entry.exc_info and entry.exc_info[0] is KeyError


async def test_a_callable_object_step_is_named_by_its_class():
    class Tagger:
        def __call__(self, c):
            raise RuntimeError("boom")

    pipeline = Pipeline()
    pipeline.before(Tagger())
    with pytest.raises(StepFailed) as info:
        await pipeline.run_before(call())
    assert info.value.step == "Tagger"


# ---------------------------------------------------------------------------------- text steps


class Upper:
    def feed(self, text):
        return text.upper()

    def flush(self):
        return ""


class HoldLast:
    """Holds each feed's last character until the next feed (or the flush)."""

    def __init__(self):
        self.held = ""

    def feed(self, text):
        text, self.held = self.held + text[:-1], text[-1:]
        return text

    def flush(self):
        held, self.held = self.held, ""
        return held


class Bomb:
    def feed(self, text):
        if "bomb" in text:
            raise ValueError("bomb")
        return text

    def flush(self):
        return ""


def test_without_text_steps_nothing_is_filtered():
    pipeline = Pipeline()
    assert not pipeline.filters_text


async def test_text_steps_run_in_order_and_the_flush_goes_through_the_later_steps():
    pipeline = Pipeline()
    pipeline.text(HoldLast)
    pipeline.text(Upper)
    assert pipeline.filters_text
    text_filter = pipeline.text_filter()
    assert await text_filter.feed("abc") == "AB"
    assert await text_filter.feed("d") == "C"
    assert await text_filter.feed("") == ""
    assert await text_filter.flush() == "D", "HoldLast's held text goes through Upper"
    assert await text_filter.flush() == ""


async def test_each_text_filter_is_fresh():
    pipeline = Pipeline()
    pipeline.text(HoldLast)
    one, two = pipeline.text_filter(), pipeline.text_filter()
    assert await one.feed("ab") == "a"
    assert await two.feed("xy") == "x"
    assert await one.flush() == "b" and await two.flush() == "y"


async def test_redactor_then_a_step_sees_only_released_text():
    pipeline = Pipeline()
    pipeline.text(lambda: Redactor(["secret"]))
    pipeline.text(Upper)
    text_filter = pipeline.text_filter()
    out = await text_filter.feed("a sec") + await text_filter.feed("ret b se")
    assert out + await text_filter.flush() == "A [REDACTED] B SE"


async def test_a_raising_text_step_is_step_failed_and_logged(caplog):
    pipeline = Pipeline()
    pipeline.text(Bomb)
    pipeline.text(Upper)
    text_filter = pipeline.text_filter()
    assert await text_filter.feed("fine") == "FINE"
    with caplog.at_level(logging.ERROR, logger="chatstream"), pytest.raises(StepFailed) as info:
        await text_filter.feed("a bomb")
    assert info.value.step == "Bomb" and info.value.message == "the pipeline step 'Bomb' failed"
    [entry] = [r for r in caplog.records if "text step" in r.getMessage()]
    assert "Bomb" in entry.getMessage() and entry.exc_info[0] is ValueError


async def test_a_text_step_failing_in_flush_is_step_failed():
    class BadFlush(Upper):
        def flush(self):
            raise OSError("disk")

    pipeline = Pipeline()
    pipeline.text(BadFlush)
    text_filter = pipeline.text_filter()
    await text_filter.feed("x")
    with pytest.raises(StepFailed) as info:
        await text_filter.flush()
    assert info.value.step.endswith("BadFlush")


async def test_a_text_step_made_by_a_lambda_is_named_by_the_step():
    pipeline = Pipeline()
    pipeline.text(lambda: Bomb())
    with pytest.raises(StepFailed) as info:
        await pipeline.text_filter().feed("bomb")
    assert info.value.step == "Bomb"


# ---------------------------------------------------------------------------------- moderation


async def test_moderation_stops_with_its_reason():
    checked = []

    async def check(text):
        checked.append(text)
        return "no shouting" if "!" in text else True

    pipeline = Pipeline()
    pipeline.moderate(check, every=5)
    assert pipeline.filters_text
    text_filter = pipeline.text_filter()
    assert await text_filter.feed("abc") == "abc"
    assert checked == []
    assert await text_filter.feed("de") == "de"
    assert checked == ["abcde"]
    with pytest.raises(ModerationStop) as info:
        await text_filter.feed("!!!!!")
    assert (info.value.status, info.value.type) == (400, "content_filter")
    assert info.value.message == "stopped by moderation: no shouting"


async def test_moderation_false_uses_the_default_reason_and_flush_checks_the_rest():
    async def check(text):
        return "x" not in text

    pipeline = Pipeline()
    pipeline.text(HoldLast)
    pipeline.moderate(check, every=100)
    text_filter = pipeline.text_filter()
    assert await text_filter.feed("abx") == "ab"
    with pytest.raises(ModerationStop) as info:
        await text_filter.flush()  # the held "x" is released, then checked
    assert info.value.message == "stopped by moderation: blocked by moderation"


async def test_each_stream_gets_its_own_gate():
    seen = []

    async def check(text):
        seen.append(text)
        return True

    pipeline = Pipeline()
    pipeline.moderate(check, every=2)
    one, two = pipeline.text_filter(), pipeline.text_filter()
    await one.feed("ab")
    await two.feed("cd")
    assert seen == ["ab", "cd"]


def test_moderate_checks_every_at_once():
    async def check(text):
        return True

    with pytest.raises(ValueError):
        Pipeline().moderate(check, every=0)


# -------------------------------------------------------------------------------- after-steps


def result():
    record = StreamRecord(endpoint="chat", model="m")
    record.texts = {0: ["hi"]}
    return record.result()


async def test_after_steps_run_in_the_background_in_order_and_failures_are_logged(caplog):
    pipeline = Pipeline()
    seen = []
    release = asyncio.Event()

    @pipeline.after
    async def slow_store(r):
        await release.wait()
        seen.append(("store", r.text))

    @pipeline.after
    def broken(r):
        raise RuntimeError("storage down")

    @pipeline.after
    def last(r):
        seen.append("last")

    assert pipeline.wants_result
    with caplog.at_level(logging.ERROR, logger="chatstream"):
        pipeline.run_after(result())  # returns at once: nothing awaited
        assert seen == [] and len(pipeline._background) == 1
        release.set()
        for _ in range(10):
            await asyncio.sleep(0)
    assert seen == [("store", "hi"), "last"], "a failing step does not stop the later ones"
    assert not pipeline._background, "the task is dropped once done"
    [entry] = [r for r in caplog.records if "after-step" in r.getMessage()]
    assert "broken" in entry.getMessage() and entry.exc_info[0] is RuntimeError


def test_without_after_steps_nothing_is_scheduled():
    pipeline = Pipeline()
    assert not pipeline.wants_result
    pipeline.run_after(result())  # no running loop needed: nothing to schedule


# ------------------------------------------------------------------------------ from settings


async def test_from_settings_orders_the_built_in_steps():
    settings = Settings.from_env({"SYSTEM_PROMPT": "Be terse.", "MAX_PROMPT_CHARS": "3", "BLOCKED_TERMS": "foo,bar"})
    pipeline = Pipeline.from_settings(settings)
    c = call(messages=[{"role": "user", "content": "abc"}])
    await pipeline.run_before(c)  # 3 characters: the system prompt added after does not count
    assert c.params["messages"][0] == {"role": "system", "content": "Be terse."}
    with pytest.raises(Rejection):
        await pipeline.run_before(call(messages=[{"role": "user", "content": "abcd"}]))
    text_filter = pipeline.text_filter()
    assert await text_filter.feed("a foo b ba") + await text_filter.flush() == "a [redacted] b ba"


async def test_from_settings_with_nothing_set_does_nothing():
    pipeline = Pipeline.from_settings(Settings.from_env({}))
    assert not pipeline.filters_text and not pipeline.wants_result
    c = call(messages=[{"role": "user", "content": "x" * 100_000}])
    await pipeline.run_before(c)
    assert c.params == call(messages=[{"role": "user", "content": "x" * 100_000}]).params


# ------------------------------------------------------------------------------ system prompt


def test_system_prompt_goes_first_in_messages():
    c = call(messages=[{"role": "system", "content": "caller's"}, {"role": "user", "content": "hi"}])
    original = c.params["messages"]
    system_prompt("Ours.")(c)
    assert c.params["messages"] == [
        {"role": "system", "content": "Ours."},
        {"role": "system", "content": "caller's"},
        {"role": "user", "content": "hi"},
    ]
    assert len(original) == 2, "the caller's list is not changed in place"


@pytest.mark.parametrize(
    "instructions, expected",
    [
        (None, "Ours."),
        ("", "Ours."),
        ("Theirs.", "Ours.\n\nTheirs."),
    ],
)
def test_system_prompt_goes_before_responses_instructions(instructions, expected):
    params = {"model": "m", "input": "hi"}
    if instructions is not None:
        params["instructions"] = instructions
    c = CallRequest(params=params, endpoint="responses")
    system_prompt("Ours.")(c)
    assert c.params["instructions"] == expected and "messages" not in c.params


# ------------------------------------------------------------------------------- prompt_chars


@pytest.mark.parametrize(
    "params, chars",
    [
        # message content: strings and text parts; role/type/name structure never counts
        ({"messages": [{"role": "user", "content": "hello"}]}, 5),
        ({"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]}, 5),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]}
                ]
            },
            5,
        ),
        ({"messages": [{"role": "user", "content": None}]}, 0),
        ({"messages": [{"role": "user", "content": ""}]}, 0),
        # an image as a data URL counts by its URL; detail does not
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD", "detail": "high"}}
                        ],
                    }
                ]
            },
            26,
        ),
        # tool calls: the arguments, the function name and the call's id (the model sees it); types do not count
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "call_123456", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_123456", "content": "42"},
                ]
            },
            11 + 1 + 7 + 11 + 2,
        ),
        # an assistant's refusal
        ({"messages": [{"role": "assistant", "refusal": "I can't"}]}, 7),
        # tools: name, description, and the whole parameter schema including property names
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get",
                            "description": "dd",
                            "strict": True,
                            "parameters": {
                                "type": "object",
                                "properties": {"city": {"type": "string"}},
                                "required": ["city"],
                            },
                        },
                    }
                ]
            },
            3 + 2 + len("typeobjectpropertiescitytypestringrequiredcity"),
        ),
        # legacy functions count the same way
        ({"functions": [{"name": "f", "parameters": {"properties": {"xy": {}}}}]}, 1 + len("propertiesxy")),
        # predicted output
        ({"prediction": {"type": "content", "content": "abcd"}}, 4),
        ({"prediction": {"type": "content", "content": [{"type": "text", "text": "ab"}]}}, 2),
        # non-string text where text belongs still reaches the model
        ({"messages": [{"role": "user", "content": 12345}]}, 5),
        ({"messages": [{"role": "user", "content": 1.5}]}, 3),
        ({"messages": [{"role": "user", "content": True}]}, 0),
        # structure (closed sets of names the upstream checks) never counts, whatever its length; ids do
        ({"messages": [{"role": "x" * 50, "content": "a", "type": "z" * 50, "status": "s" * 9}]}, 1),
        ({"messages": [{"role": "user", "content": "a", "id": "y" * 50}]}, 51),
        # the Responses API's ids: an item's, a function call's call_id, an item_reference's
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c" * 30, "output": "ok"},
                    {"type": "item_reference", "id": "msg_1"},
                ]
            },
            30 + 2 + 5,
        ),
        # tool_choice and response_format schemas
        ({"tool_choice": "auto"}, 4),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
            len("namenschematypeobject"),
        ),
        # the Responses API: input and instructions
        ({"input": "hello", "instructions": "be brief"}, 5 + 8),
        ({"input": [{"role": "user", "type": "message", "content": [{"type": "input_text", "text": "abc"}]}]}, 3),
        # fields that are not prompt text never count
        ({"model": "gpt-4o", "temperature": 0.5, "user": "someone", "metadata": {"k": "v"}, "stream": True}, 0),
    ],
)
def test_prompt_chars(params, chars):
    assert prompt_chars(params) == chars


def test_prompt_chars_sums_every_field():
    params = {
        "messages": [{"role": "user", "content": "abc"}],
        "tools": [{"function": {"description": "de"}}],
        "prediction": {"content": "f"},
        "instructions": "g",
    }
    assert prompt_chars(params) == 7


async def test_max_prompt_chars_allows_the_limit_and_refuses_one_more():
    step = max_prompt_chars(5)
    step(call(messages=[{"role": "user", "content": "12345"}]))
    with pytest.raises(Rejection) as info:
        step(call(messages=[{"role": "user", "content": "123456"}]))
    error = info.value
    assert (error.status, error.type, error.param) == (413, "prompt_too_long", "messages")
    assert error.message == "the prompt has 6 characters; the limit is 5"


def test_max_prompt_chars_names_input_for_the_responses_api():
    with pytest.raises(Rejection) as info:
        max_prompt_chars(2)(CallRequest(params={"model": "m", "input": "abc"}, endpoint="responses"))
    assert info.value.param == "input"


def test_call_request_messages():
    c = call()
    assert c.messages is c.params["messages"] and c.include_usage is False
