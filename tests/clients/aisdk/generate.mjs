// One generateText call of the Vercel AI SDK (ai 4.x, its default retries: 2, after 2 s and 4 s),
// against the app's OpenAI-compatible API. Usage: node generate.mjs BASE_URL PROMPT
// Prints one JSON line: how the call ended, and the status of each attempt.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText } from "ai";

const [baseURL, prompt] = process.argv.slice(2);
const openai = createOpenAI({ baseURL, apiKey: "unused" });
const started = Date.now();
try {
  const { text } = await generateText({ model: openai("gpt-test"), prompt });
  console.log(JSON.stringify({ ok: true, text, seconds: (Date.now() - started) / 1000 }));
} catch (error) {
  const attempts = error.errors ?? [error];
  console.log(JSON.stringify({
    ok: false,
    name: error.name,
    reason: error.reason ?? null,
    statuses: attempts.map((e) => e.statusCode ?? null),
    seconds: (Date.now() - started) / 1000,
  }));
}
