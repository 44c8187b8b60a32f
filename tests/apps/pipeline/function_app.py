"""The function app with custom pipeline steps, declared the way a user would in function_app.py.
Used by tests/test_pipeline.py (not deployed)."""

import asyncio
import dataclasses
import json
import os

import azure.functions as func
from azurefunctions.extensions.http.fastapi import Request, Response

from chatstream.app import create_app
from chatstream.pipeline import CallRequest, Pipeline, Rejection, StreamResult
from chatstream.settings import Settings

settings = Settings.from_env()
pipeline = Pipeline.from_settings(settings)  # SYSTEM_PROMPT, MAX_PROMPT_CHARS, BLOCKED_TERMS


@pipeline.before
def refuse_marked_requests(call: CallRequest) -> None:
    last = call.messages[-1]["content"]
    if "[explode-before]" in last:
        raise RuntimeError("a bug in a before-step")
    if "[reject]" in last:
        raise Rejection(422, "this request is refused by policy", "policy")
    if "[stream-off]" in last:  # /api/chat cannot answer unstreamed: a JSON 500, not a crash
        call.params["stream"] = False
    if "[add-param]" in last:  # an unknown parameter goes to the upstream, whose 400 comes back
        call.params["bogus_param"] = 1


class BombFilter:
    """A text step that fails when it sees 'bomb' (held back like a one-term redactor would)."""

    def feed(self, text: str) -> str:
        if "bomb" in text:
            raise ValueError("found a bomb")
        return text

    def flush(self) -> str:
        return ""


pipeline.text(BombFilter)


async def no_every_two(text_so_far: str):
    await asyncio.sleep(0)  # a real hook would call a moderation service here
    return "'every two' is not allowed" if "every two" in text_so_far else True


pipeline.moderate(no_every_two, every=8)


@pipeline.after
async def record_result(result: StreamResult) -> None:
    await asyncio.sleep(3.0)  # slow storage: must not delay the caller
    with open(os.environ["PIPELINE_RESULTS"], "a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(result), ensure_ascii=False) + "\n")


chat_app = create_app(settings, pipeline)
app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> Response:
    return await chat_app.chat(req)


@app.route(route="v1/chat/completions", methods=["POST"])
async def chat_completions(req: Request) -> Response:
    return await chat_app.chat_completions(req)
