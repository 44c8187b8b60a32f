// One streamText call of the Vercel AI SDK (ai 4.x) on the app's chat completions, through
// clients/js/chatstream-fetch.mjs unless told otherwise. Usage: node stream.mjs BASE_URL PROMPT [OPTIONS_JSON]
// OPTIONS_JSON: {"plain": true} (no wrapper), or the wrapper's options (streamsUrl, maxAttempts, …).
// Prints one JSON line: the text, the finish parts seen, the error parts seen.
import { createOpenAI } from "@ai-sdk/openai";
import { streamText } from "ai";
import { resumingFetch } from "../../../clients/js/chatstream-fetch.mjs";

const [baseURL, prompt, optionsJson] = process.argv.slice(2);
const { plain, ...options } = JSON.parse(optionsJson ?? "{}");
const log = (message) => process.stderr.write(`${Date.now() / 1000} ${message}\n`);
const openai = createOpenAI({ baseURL, apiKey: "unused", ...(plain ? {} : { fetch: resumingFetch({ log, ...options }) }) });
const started = Date.now();
let text = "";
const finishes = [];
const errors = [];
try {
  const result = streamText({ model: openai.chat("gpt-test"), prompt, maxRetries: 0 });
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") text += part.textDelta;
    else if (part.type === "finish") finishes.push(part.finishReason);
    else if (part.type === "error") errors.push(String(part.error?.message ?? part.error));
  }
  console.log(JSON.stringify({ ok: errors.length === 0, text, finishes, errors, seconds: (Date.now() - started) / 1000 }));
} catch (error) {
  console.log(JSON.stringify({ ok: false, text, finishes, errors: [...errors, String(error.message)], seconds: (Date.now() - started) / 1000 }));
}
