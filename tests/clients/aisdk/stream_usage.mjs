// One streamText call of the Vercel AI SDK (ai 4.x) over the app's chat completions.
// Usage: node stream_usage.mjs BASE_URL PROMPT
// Prints one JSON line: the text, the finish reason and the usage the SDK reports, or the error.
import { createOpenAI } from "@ai-sdk/openai";
import { streamText } from "ai";

const [baseURL, prompt] = process.argv.slice(2);
// "strict": it asks for the usage chunk (stream_options.include_usage), as OpenAI itself would be asked.
const openai = createOpenAI({ baseURL, apiKey: "unused", compatibility: "strict" });
try {
  const result = streamText({ model: openai.chat("gpt-test"), prompt, maxRetries: 0 });
  let text = "";
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") text += part.textDelta;
    if (part.type === "error") throw part.error;
  }
  console.log(JSON.stringify({ ok: true, text, finishReason: await result.finishReason, usage: await result.usage }));
} catch (error) {
  console.log(JSON.stringify({ ok: false, name: error.name, message: String(error.message) }));
}
