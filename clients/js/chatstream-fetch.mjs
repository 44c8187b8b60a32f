// A fetch that resumes the chatstream app's resumable streams (RESUMABLE_STREAMS=on) after a cut, so
// an unchanged SDK reads the whole answer once:
//
//   import { resumingFetch } from "./chatstream-fetch.mjs";
//   const client = new OpenAI({ baseURL, apiKey, fetch: resumingFetch() });       // openai-node
//   const openai = createOpenAI({ baseURL, apiKey, fetch: resumingFetch() });     // the AI SDK
//
// An answer with `x-stream-id` is passed on as a ReadableStream of its whole events; when its
// connection is cut (a read error, or the body ending before the final event) it reconnects to
// GET …/streams/{id} with Last-Event-ID = the last event passed on and splices the rest in: no
// event twice, none partial, nothing after the final one. Every other answer is returned untouched.
// The rules (the same as the Python transports', clients/python/chatstream_client/resumption.py):
//   where:   the request URL with its route (/v1/chat/completions, /chat/completions, /chat) replaced
//            by /streams/{id}; a path ending otherwise has its last segment replaced; same origin.
//            `streamsUrl` overrides it: a template with {id}, or (requestUrl, id) => url.
//   with:    the request's Authorization, api-key, x-functions-key, Ocp-Apim-Subscription-Key headers
//            and its `code` query parameter; its AbortSignal.
//   retried: connection errors; 429 and 503 (after Retry-After when longer than the backoff);
//            408, 500, 502, 504. Any other status (404, 400, 401, 403) ends it.
//   bound:   waits of 0.25 s doubling to 4 s, at most 8 reconnects within 30 s of the cut (a resume
//            that passes a new event starts a new count).
//   giving up: the stream errors with the cut's own error (undici's `TypeError: terminated`, …),
//            or, when the last body ended with the app's own error event, that event is passed on.
// No dependencies; Node 18+ and browsers.

const STREAM_ID = /^[A-Za-z0-9_-]{1,128}$/;
const ROUTES = ["/v1/chat/completions", "/chat/completions", "/chat"];
const FORWARDED = ["authorization", "api-key", "x-functions-key", "ocp-apim-subscription-key"];
const RETRIED = new Set([408, 429, 500, 502, 503, 504]);
const LF = 10;
const CR = 13;
const COLON = 58;
const SPACE = 32;
const DEFAULTS = { maxAttempts: 8, maxSeconds: 30, firstDelay: 0.25, maxDelay: 4 };

const ascii = new TextDecoder("utf-8");
const encoder = new TextEncoder();
const DONE = encoder.encode("[DONE]");
const ERROR_KEY = encoder.encode('"error"');

/** The splice (sans I/O): feed it each body's bytes, tell it when a body ends. */
export class Splice {
  constructor() {
    this.lastId = null; // the id of the last event passed on (sent as Last-Event-ID)
    this.final = false; // the final event passed on: nothing more passes
    this.held = null; // an id-less error event that ended the current body (stream_store_unavailable, stream_moved)
    this.passedEvents = 0;
    this._buffer = new Uint8Array(0);
    this._scan = 0;
    this._afterCr = false; // the last line ended with a CR at the end of the data: an LF next is its
    this._lfPasses = false;
    this._resetEvent();
  }

  get bodyOver() {
    return this.final || this.held !== null;
  }

  /** Bytes of the current body; returns the whole events among them to pass on (a Uint8Array). */
  feed(data) {
    if (this.bodyOver || data.length === 0) {
      if (this.final && this._afterCr && this._lfPasses && data[0] === LF) {
        this._afterCr = false;
        return Uint8Array.of(LF);
      }
      this._afterCr = false;
      return new Uint8Array(0);
    }
    const buffer = concat(this._buffer, data);
    const out = [];
    let start = 0;
    let scan = this._scan;
    if (this._afterCr) {
      this._afterCr = false;
      if (buffer[scan] === LF) {
        scan += 1;
        if (this._lineCount === 0) {
          if (this._lfPasses) out.push(buffer.subarray(0, scan));
          start = scan;
        }
      }
    }
    for (;;) {
      let end = scan;
      while (end < buffer.length && buffer[end] !== LF && buffer[end] !== CR) end++;
      if (end >= buffer.length) break;
      const line = buffer.subarray(scan, end);
      let after = end + 1;
      if (buffer[end] === CR) {
        if (after < buffer.length) {
          if (buffer[after] === LF) after += 1;
        } else {
          this._afterCr = true;
        }
      }
      scan = after;
      if (line.length > 0) {
        this._field(line);
        continue;
      }
      const event = buffer.subarray(start, scan);
      start = scan;
      const passed = this._dispatch(event);
      this._lfPasses = passed !== null;
      if (passed !== null) out.push(passed);
      if (this.bodyOver) break;
    }
    if (this.bodyOver) {
      this._buffer = new Uint8Array(0);
      this._scan = 0;
    } else {
      this._buffer = buffer.slice(start);
      this._scan = scan - start;
    }
    return concat(...out);
  }

  /** The current body ended, cleanly or not: its partial event is dropped. */
  bodyEnded() {
    this._buffer = new Uint8Array(0);
    this._scan = 0;
    this._afterCr = false;
    this._resetEvent();
  }

  /** A new body (a resume) starts: the held event of the last one is dropped. */
  resume() {
    this.held = null;
    this.bodyEnded();
  }

  takeHeld() {
    const held = this.held ?? new Uint8Array(0);
    this.held = null;
    return held;
  }

  _resetEvent() {
    this._lineCount = 0;
    this._id = null;
    this._name = "";
    this._data = [];
  }

  _field(line) {
    this._lineCount += 1;
    if (line[0] === COLON) return; // a comment
    let colon = line.indexOf(COLON);
    const name = ascii.decode(colon < 0 ? line : line.subarray(0, colon));
    let value = colon < 0 ? new Uint8Array(0) : line.subarray(colon + 1);
    if (value[0] === SPACE) value = value.subarray(1);
    if (name === "id") {
      if (!value.includes(0)) this._id = ascii.decode(value);
    } else if (name === "event") {
      this._name = ascii.decode(value);
    } else if (name === "data") {
      this._data.push(value);
    }
  }

  _dispatch(event) {
    const id = this._id;
    const name = this._name;
    const data = this._data;
    this._resetEvent();
    const copy = event.slice();
    if (id === null) {
      if (data.length > 0 && isFinal(name, data)) {
        this.held = copy;
        return null;
      }
      return copy; // a comment (a keep-alive), an empty line, an event we do not know
    }
    if (notAfter(id, this.lastId)) return null; // already passed on (a resume replayed it)
    this.lastId = id;
    this.passedEvents += 1;
    if (isFinal(name, data)) this.final = true;
    return copy;
  }
}

function notAfter(id, last) {
  if (last === null || !/^\d+$/.test(id) || !/^\d+$/.test(last)) return false;
  return BigInt(id) <= BigInt(last);
}

function isFinal(name, data) {
  if (name === "done" || name === "error") return true;
  if (name !== "" && name !== "message") return false;
  const text = data.length === 1 ? data[0] : joinLines(data);
  if (equalBytes(text, DONE)) return true;
  if (indexOf(text, ERROR_KEY) < 0) return false;
  try {
    const value = JSON.parse(ascii.decode(text));
    return value !== null && typeof value === "object" && !Array.isArray(value) && "error" in value;
  } catch {
    return false;
  }
}

function joinLines(parts) {
  const out = [];
  parts.forEach((part, i) => {
    if (i > 0) out.push(Uint8Array.of(LF));
    out.push(part);
  });
  return concat(...out);
}

function concat(...parts) {
  if (parts.length === 1) return parts[0];
  let size = 0;
  for (const part of parts) size += part.length;
  const out = new Uint8Array(size);
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}

function equalBytes(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

function indexOf(haystack, needle) {
  outer: for (let i = 0; i + needle.length <= haystack.length; i++) {
    for (let j = 0; j < needle.length; j++) if (haystack[i + j] !== needle[j]) continue outer;
    return i;
  }
  return -1;
}

/** Where the stream `id`, answered to a request to `requestUrl`, resumes (see the top). */
export function streamsUrlFor(requestUrl, id, override) {
  const url = new URL(requestUrl);
  let target;
  if (typeof override === "function") {
    target = new URL(String(override(url.href, id)));
  } else if (override) {
    target = new URL(String(override).replaceAll("{id}", id));
  } else {
    const route = ROUTES.find((r) => url.pathname.endsWith(r));
    const prefix = route ? url.pathname.slice(0, -route.length) : url.pathname.slice(0, url.pathname.lastIndexOf("/"));
    target = new URL(url.origin);
    target.pathname = `${prefix}/streams/${id}`;
  }
  const code = url.searchParams.get("code");
  if (code !== null && !target.searchParams.has("code")) target.searchParams.set("code", code);
  return target.href;
}

function retryAfter(response) {
  const ms = Number.parseFloat(response.headers.get("retry-after-ms") ?? "");
  if (Number.isFinite(ms)) return Math.max(0, ms / 1000);
  const value = response.headers.get("retry-after");
  if (value === null) return null;
  const seconds = Number(value);
  if (value.trim() !== "" && Number.isFinite(seconds)) return Math.max(0, seconds);
  const when = Date.parse(value);
  return Number.isFinite(when) ? Math.max(0, (when - Date.now()) / 1000) : null;
}

function sleep(seconds, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(done, seconds * 1000);
    function done() {
      signal?.removeEventListener("abort", aborted);
      resolve();
    }
    function aborted() {
      clearTimeout(timer);
      reject(signal.reason);
    }
    signal?.addEventListener("abort", aborted, { once: true });
  });
}

class GiveUp extends Error {}

/**
 * A fetch-compatible function for `new OpenAI({ fetch })` and `createOpenAI({ fetch })`.
 * options: fetch (the one to wrap; default globalThis.fetch), streamsUrl, maxAttempts (8),
 * maxSeconds (30), firstDelay (0.25 s), maxDelay (4 s), log (a function of one message; default none).
 */
export function resumingFetch(options = {}) {
  const inner = options.fetch ?? globalThis.fetch;
  const backoff = { ...DEFAULTS };
  for (const key of Object.keys(DEFAULTS)) if (options[key] !== undefined) backoff[key] = Number(options[key]);
  const log = options.log ?? (() => {});

  return async function fetchResuming(input, init) {
    const response = await inner(input, init);
    const id = response.headers.get("x-stream-id");
    const type = response.headers.get("content-type") ?? "";
    if (response.status !== 200 || !response.body || !id || !STREAM_ID.test(id) || !type.startsWith("text/event-stream")) {
      return response;
    }
    const requestUrl = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
    const headers = new Headers(typeof input === "object" && "headers" in input ? input.headers : undefined);
    new Headers(init?.headers).forEach((value, name) => headers.set(name, value));
    const forwarded = {};
    for (const name of FORWARDED) if (headers.has(name)) forwarded[name] = headers.get(name);
    const signal = init?.signal ?? (typeof input === "object" && "signal" in input ? input.signal : undefined);
    const resume = new Resumption(inner, streamsUrlFor(requestUrl, id, options.streamsUrl), id, forwarded, signal, backoff, log);
    const body = resume.stream(response.body);
    const spliced = new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
    Object.defineProperty(spliced, "url", { value: response.url });
    return spliced;
  };
}

class Resumption {
  constructor(inner, url, id, headers, signal, backoff, log) {
    Object.assign(this, { inner, url, id, headers, signal, backoff, log });
    this.splice = new Splice();
    this.error = null;
    this.attempt = 0;
    this.deadline = 0;
    this.mark = -1;
    this.reader = null;
    this.cancelled = false;
  }

  stream(first) {
    this.reader = first.getReader();
    return new ReadableStream({
      pull: (controller) => this._pull(controller),
      cancel: async (reason) => {
        this.cancelled = true;
        await this.reader?.cancel(reason).catch(() => {});
      },
    });
  }

  async _pull(controller) {
    const splice = this.splice;
    for (;;) {
      if (this.reader === null) return;
      let error = null;
      try {
        const { done, value } = await this.reader.read();
        if (!done) {
          const out = splice.feed(value);
          if (out.length > 0) controller.enqueue(out);
          if (splice.held === null) {
            if (out.length > 0) return;
            continue;
          }
        }
      } catch (caught) {
        if (this.cancelled || this.signal?.aborted) throw caught;
        error = caught;
      }
      // the body ended: the final event (the rest of the body is dropped), held (the reading ended), or cut
      this.reader.cancel().catch(() => {});
      this.reader = null;
      if (splice.final) return controller.close();
      if (this.cancelled) return;
      this._cut(error);
      try {
        this.reader = await this._reconnect();
      } catch (reason) {
        if (!(reason instanceof GiveUp)) throw reason;
        this.log(`chatstream-fetch: stream ${this.id}: giving up: ${reason.message}`);
        if (splice.held !== null) {
          controller.enqueue(splice.takeHeld());
          return controller.close();
        }
        throw this.error;
      }
    }
  }

  _cut(error) {
    this.splice.bodyEnded();
    if (this.splice.passedEvents !== this.mark) {
      this.mark = this.splice.passedEvents;
      this.attempt = 0;
      this.deadline = Date.now() + this.backoff.maxSeconds * 1000;
      this.error = error ?? new TypeError(`terminated: stream ${this.id} ended before its final event`);
      this.log(`chatstream-fetch: stream ${this.id} cut after id ${this.splice.lastId} (${error})`);
    }
  }

  _nextDelay(hint) {
    this.attempt += 1;
    const { maxAttempts, firstDelay, maxDelay, maxSeconds } = this.backoff;
    if (this.attempt > maxAttempts) throw new GiveUp(`${maxAttempts} reconnects failed`);
    const delay = Math.max(Math.min(firstDelay * 2 ** (this.attempt - 1), maxDelay), hint ?? 0);
    if (Date.now() + delay * 1000 > this.deadline) throw new GiveUp(`no reconnect left within ${maxSeconds} s of the cut`);
    this.log(`chatstream-fetch: stream ${this.id}: reconnect ${this.attempt}/${maxAttempts} in ${delay} s`);
    return delay;
  }

  async _reconnect() {
    let hint = null;
    for (;;) {
      await sleep(this._nextDelay(hint), this.signal);
      if (this.cancelled) throw new GiveUp("the response was cancelled");
      const headers = { ...this.headers, accept: "text/event-stream", "cache-control": "no-cache" };
      if (this.splice.lastId !== null) headers["last-event-id"] = this.splice.lastId;
      let response;
      try {
        response = await this.inner(this.url, { method: "GET", headers, signal: this.signal });
      } catch (error) {
        if (this.signal?.aborted) throw error;
        this.log(`chatstream-fetch: stream ${this.id}: reconnect failed: ${error}`);
        hint = null;
        continue;
      }
      if (response.status === 200 && response.body) {
        this.splice.resume();
        return response.body.getReader();
      }
      this.log(`chatstream-fetch: stream ${this.id}: resume answered ${response.status}`);
      await response.body?.cancel().catch(() => {});
      if (!RETRIED.has(response.status)) throw new GiveUp(`the resume answered ${response.status}`);
      hint = retryAfter(response);
    }
  }
}
