// The JavaScript wrapper's splice and fetch (clients/js/chatstream-fetch.mjs), the properties of
// tests/unit/test_resuming_splice.py (which runs this file with `node --test`): random streams cut at
// random bytes, read in random pieces, pass exactly once, whole events only; and the fetch against an
// in-process HTTP server whose answers are cut by destroying the socket mid-body.
import assert from "node:assert/strict";
import http from "node:http";
import test from "node:test";
import { resumingFetch, Splice, streamsUrlFor } from "../../clients/js/chatstream-fetch.mjs";

const encoder = new TextEncoder();
const decoder = new TextDecoder();
const ENDINGS = ["\n", "\r\n", "\r"];
const WORDS = ["", "a", "café", "🙂🚀", "日本語", 'q"uote', "back\\slash", "x y z"];

function random(seed) {
  // mulberry32: the same examples every run
  return () => {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function stream(rand) {
  const ending = ENDINGS[Math.floor(rand() * 3)];
  const events = [];
  const ids = [];
  const count = Math.floor(rand() * 8);
  let n = 0;
  for (let k = 0; k < count; k++) {
    if (rand() < 0.25) {
      events.push(`: keep-alive${ending}${ending}`);
      ids.push(0);
    }
    n += 1;
    const word = WORDS[Math.floor(rand() * WORDS.length)];
    events.push(`id: ${n}${ending}data: {"delta":"${word}"}${ending}${ending}`);
    ids.push(n);
  }
  n += 1;
  const finals = ["data: [DONE]", 'event: done\ndata: {"finish_reason":"stop"}', 'data: {"error":{"x":1}}'];
  events.push(`id: ${n}${ending}${finals[Math.floor(rand() * 3)].replaceAll("\n", ending)}${ending}${ending}`);
  ids.push(n);
  return { events: events.map((e) => encoder.encode(e)), ids };
}

const join = (parts) => {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
};
const after = ({ events, ids }, last) => join(events.filter((_, i) => ids[i] && ids[i] > (last ?? 0)));
// events only (a resume replays no keep-alive), line ends as LF (see the Python test's events_of)
const eventsOf = (bytes) =>
  decoder.decode(bytes).replaceAll("\r\n", "\n").replaceAll("\r", "\n").replaceAll(": keep-alive\n\n", "");

function pieces(data, rand) {
  const out = [];
  for (let at = 0; at < data.length; ) {
    const size = 1 + Math.floor(rand() * 40);
    out.push(data.subarray(at, at + size));
    at += size;
  }
  return out;
}

test("uncut, the bytes pass unchanged, whole events only", () => {
  const rand = random(1);
  for (let k = 0; k < 300; k++) {
    const s = stream(rand);
    const whole = join(s.events);
    const ends = new Set([0]);
    let at = 0;
    for (const e of s.events) {
      at += e.length;
      ends.add(at);
      if (e.at(-1) === 10 && e.at(-2) === 13) ends.add(at - 1);
    }
    const splice = new Splice();
    const out = [];
    let size = 0;
    for (const piece of pieces(whole, rand)) {
      const got = splice.feed(piece);
      out.push(got);
      size += got.length;
      assert.ok(ends.has(size), `partial event passed at ${size}`);
    }
    assert.deepEqual(join(out), whole);
    assert.ok(splice.final);
  }
});

test("cut anywhere, any number of times: the events pass exactly once", () => {
  const rand = random(2);
  for (let k = 0; k < 500; k++) {
    const s = stream(rand);
    const whole = join(s.events);
    const splice = new Splice();
    const out = [];
    let body = whole;
    const cuts = Math.floor(rand() * 4);
    for (let c = 0; c <= cuts; c++) {
      if (c < cuts) body = body.subarray(0, Math.floor(body.length * rand()));
      for (const piece of pieces(body, rand)) out.push(splice.feed(piece));
      if (splice.final) break;
      splice.bodyEnded();
      splice.resume();
      const last = splice.lastId === null ? null : Number(splice.lastId);
      // now and then a resume that replays from earlier than asked: nothing passes twice
      body = after(s, rand() < 0.2 ? Math.max(0, (last ?? 0) - 2) : last);
    }
    if (!splice.final) for (const piece of pieces(after(s, Number(splice.lastId ?? 0)), rand)) out.push(splice.feed(piece));
    assert.equal(eventsOf(join(out)), eventsOf(whole));
    assert.ok(splice.final);
  }
});

test("an id-less error event is held and ends the body; nothing passes after the final event", () => {
  const splice = new Splice();
  const unavailable = 'data: {"error":{"code":"stream_store_unavailable"}}\n\n';
  const out = splice.feed(encoder.encode(`id: 3\ndata: {}\n\n${unavailable}id: 4\ndata: {}\n\n`));
  assert.equal(decoder.decode(out), "id: 3\ndata: {}\n\n");
  assert.equal(decoder.decode(splice.held), unavailable);
  assert.equal(splice.lastId, "3");
  const done = new Splice();
  done.feed(encoder.encode("id: 1\ndata: [DONE]\n\n"));
  assert.equal(done.feed(encoder.encode("id: 2\ndata: {}\n\n")).length, 0);
});

test("the streams URL is the route replaced, with the code parameter", () => {
  assert.equal(streamsUrlFor("http://h:7071/api/v1/chat/completions", "S"), "http://h:7071/api/streams/S");
  assert.equal(streamsUrlFor("http://h/api/chat?code=K&x=1", "S"), "http://h/api/streams/S?code=K");
  assert.equal(streamsUrlFor("http://h/gw/openai/chat/completions", "S"), "http://h/gw/openai/streams/S");
  assert.equal(streamsUrlFor("http://h/a/other", "S"), "http://h/a/streams/S");
  assert.equal(streamsUrlFor("http://h/api/chat?code=K", "S", "https://o/x/{id}"), "https://o/x/S?code=K");
  assert.equal(streamsUrlFor("http://h/api/chat", "S", (u, id) => `https://o/${id}`), "https://o/S");
});

// --- the fetch against a real HTTP server -------------------------------------------------------

const EVENTS = [1, 2, 3, 4, 5, 6].map((n) => `id: ${n}\ndata: {"delta":"w${n} 🙂"}\n\n`).concat(["id: 7\ndata: [DONE]\n\n"]);

/** A server of one stream: `script` says what each request after the POST gets (a cut fraction, a
 * [status, headers] pair, or null for the whole rest); the POST is cut at `first`. */
async function serve(first, script) {
  const seen = [];
  const server = http.createServer((request, response) => {
    seen.push({ method: request.method, url: request.url, headers: request.headers, at: Date.now() });
    request.resume();
    const step = request.method === "POST" ? first : script.shift() ?? null;
    if (Array.isArray(step)) {
      response.writeHead(step[0], { "content-type": "application/json", ...step[1] });
      return response.end('{"error":{"message":"no","type":"x"}}');
    }
    const last = Number(request.headers["last-event-id"] ?? 0);
    const body = encoder.encode(EVENTS.filter((_, i) => i + 1 > last).join(""));
    response.writeHead(200, { "content-type": "text/event-stream", "x-stream-id": "S".repeat(30) });
    if (step === null) return response.end(body);
    response.write(body.subarray(0, Math.floor(body.length * step)), () => setTimeout(() => response.socket.destroy(), 20));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return { url: `http://127.0.0.1:${server.address().port}`, seen, close: () => server.close() };
}

async function readAll(response) {
  const parts = [];
  for await (const part of response.body) parts.push(part);
  return decoder.decode(join(parts));
}

const fast = { firstDelay: 0.005, maxDelay: 0.02, maxAttempts: 4, maxSeconds: 5 };
const auth = { authorization: "Bearer csk-1", "api-key": "k2", "x-functions-key": "fk", "x-other": "no" };

test("fetch: cut twice, the body is the whole stream once, resumes carry the auth", async () => {
  const server = await serve(0.3, [0.5, null]);
  try {
    const f = resumingFetch(fast);
    const response = await f(`${server.url}/api/v1/chat/completions?code=FK`, { method: "POST", headers: auth, body: "{}" });
    assert.equal(await readAll(response), EVENTS.join(""));
    assert.equal(server.seen.length, 3);
    for (const r of server.seen.slice(1)) {
      assert.equal(r.method, "GET");
      assert.equal(r.url, `/api/streams/${"S".repeat(30)}?code=FK`);
      assert.equal(r.headers.authorization, "Bearer csk-1");
      assert.equal(r.headers["api-key"], "k2");
      assert.equal(r.headers["x-functions-key"], "fk");
      assert.equal(r.headers["x-other"], undefined);
    }
    assert.ok(Number(server.seen[1].headers["last-event-id"]) < Number(server.seen[2].headers["last-event-id"]));
  } finally {
    server.close();
  }
});

test("fetch: a 503 with Retry-After is tried again after it", async () => {
  const server = await serve(0.5, [[503, { "retry-after-ms": "300" }], null]);
  try {
    const response = await resumingFetch(fast)(`${server.url}/api/chat`, { method: "POST", body: "{}" });
    assert.equal(await readAll(response), EVENTS.join(""));
    assert.ok(server.seen[2].at - server.seen[1].at >= 290, "Retry-After was not waited for");
  } finally {
    server.close();
  }
});

test("fetch: a 404 ends with the cut's error; so does the bound", async () => {
  for (const [script, requests] of [
    [[[404, {}]], 2],
    [[[503, {}], [503, {}], [503, {}], [503, {}], null], 1 + fast.maxAttempts],
  ]) {
    const server = await serve(0.5, script);
    try {
      const response = await resumingFetch(fast)(`${server.url}/api/chat`, { method: "POST", body: "{}" });
      await assert.rejects(readAll(response), (error) => error instanceof TypeError && /terminated/.test(error.message));
      assert.equal(server.seen.length, requests);
    } finally {
      server.close();
    }
  }
});

test("fetch: an answer without x-stream-id is returned untouched", async () => {
  const server = http.createServer((request, response) => response.end("plain"));
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  try {
    const url = `http://127.0.0.1:${server.address().port}/api/chat`;
    const response = await resumingFetch(fast)(url);
    assert.equal(await response.text(), "plain");
  } finally {
    server.close();
  }
});
