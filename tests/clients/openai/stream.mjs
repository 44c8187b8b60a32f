// One streamed chat completion of the openai npm SDK against the app, through
// clients/js/chatstream-fetch.mjs unless told otherwise. Usage: node stream.mjs BASE_URL PROMPT [OPTIONS_JSON]
// OPTIONS_JSON: {"plain": true} (no wrapper), or the wrapper's options (streamsUrl, maxAttempts, …).
// Prints one JSON line: the text, the finish reasons seen, the usage chunks seen, or the error.
import OpenAI from "openai";
import { resumingFetch } from "../../../clients/js/chatstream-fetch.mjs";

const [baseURL, prompt, optionsJson] = process.argv.slice(2);
const { plain, ...options } = JSON.parse(optionsJson ?? "{}");
const log = (message) => process.stderr.write(`${Date.now() / 1000} ${message}\n`);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, ...(plain ? {} : { fetch: resumingFetch({ log, ...options }) }) });
const started = Date.now();
let text = "";
const finishes = [];
let usages = 0;
try {
  const stream = await client.chat.completions.create({
    model: "gpt-test",
    messages: [{ role: "user", content: prompt }],
    stream: true,
    stream_options: { include_usage: true },
  });
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      text += choice.delta?.content ?? "";
      if (choice.finish_reason) finishes.push(choice.finish_reason);
    }
    if (chunk.usage) usages += 1;
  }
  console.log(JSON.stringify({ ok: true, text, finishes, usages, seconds: (Date.now() - started) / 1000 }));
} catch (error) {
  const cause = error.cause ? `${error.cause.name}: ${error.cause.message}` : null;
  console.log(JSON.stringify({ ok: false, text, finishes, usages, name: error.constructor.name, message: String(error.message), cause, seconds: (Date.now() - started) / 1000 }));
}
