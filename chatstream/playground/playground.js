// The chat playground: talks to this app's own OpenAI-compatible API with relative URLs
// (v1/models, v1/chat/completions), reads the streamed answer with fetch + ReadableStream and a
// small server-sent-events parser, and shows it as text: the model's text only ever goes into text
// nodes, never into HTML. When the app makes the stream resumable (it answers with `x-stream-id`), a
// dropped connection is picked up again (streams/ID with Last-Event-ID), so is a reload of the page
// mid-answer (the stream id, the last event id and the text so far are kept in sessionStorage), and
// Stop asks the app to cancel the stream (a hang-up no longer stops it).
"use strict";

// ------------------------------------------------------------------ server-sent events

/** Bytes in, events out. Lines may end in CRLF, CR or LF; a read may end inside a line, between a
 *  CR and its LF, or inside a multi-byte UTF-8 character. Comments (":") are skipped; an event
 *  without a terminating blank line when the stream ends is dropped, as the EventSource rules say.
 *  Each event comes with the value of its own "id:" line (unlike EventSource's lastEventId, which an
 *  event without one inherits), so that an event is only ever counted by the id it was sent with. */
class SseParser {
  constructor() {
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.skipLF = false; // the last read ended with CR: a LF starting the next one belongs to it
    this.data = [];
    this.event = "";
    this.id = ""; // this event's own "id:" line ("" without one)
  }

  /** Feed one read's bytes; returns the events completed by them: [{event, data, id}]. */
  push(bytes) {
    return this.text(this.decoder.decode(bytes, { stream: true }));
  }

  /** The stream has ended: flush the decoder; returns any last completed events. */
  end() {
    return this.text(this.decoder.decode());
  }

  text(piece) {
    if (this.skipLF && piece.length > 0) {
      if (piece[0] === "\n") piece = piece.slice(1);
      this.skipLF = false;
    }
    this.buffer += piece;
    const events = [];
    const breaks = /\r\n|\r|\n/g;
    let start = 0;
    let m;
    while ((m = breaks.exec(this.buffer)) !== null) {
      this.line(this.buffer.slice(start, m.index), events);
      start = breaks.lastIndex;
      if (m[0] === "\r" && start === this.buffer.length) this.skipLF = true;
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  line(line, events) {
    if (line === "") {
      if (this.data.length > 0) {
        events.push({ event: this.event || "message", data: this.data.join("\n"), id: this.id });
      }
      this.data = [];
      this.event = "";
      this.id = "";
      return;
    }
    if (line[0] === ":") return;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value[0] === " ") value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
    else if (field === "id" && !value.includes("\0")) this.id = value;
  }
}

// ------------------------------------------------------------------ the API

// Two keys, each kept in this tab only (sessionStorage): the Functions key (x-functions-key, the
// platform's gate in Azure) and the caller key (Authorization: Bearer, when the app requires caller keys).
const KEY_ITEM = "chatstream.functionKey";
const CALLER_ITEM = "chatstream.callerKey";

function stored(item) {
  try {
    return sessionStorage.getItem(item) || "";
  } catch {
    return "";
  }
}

function store(item, key) {
  try {
    if (key) sessionStorage.setItem(item, key);
    else sessionStorage.removeItem(item);
  } catch {
    // storage refused (private mode): the key then lives as long as the input field's text
  }
}

/** Options for fetch() to this app: the keys only as headers, never followed elsewhere. */
function apiInit(init = {}) {
  const headers = { ...(init.headers || {}) };
  const key = stored(KEY_ITEM);
  if (key) headers["x-functions-key"] = key;
  const caller = stored(CALLER_ITEM);
  if (caller) headers["authorization"] = `Bearer ${caller}`;
  return { ...init, headers, cache: "no-store", credentials: "same-origin", redirect: "error" };
}

/** A non-2xx answer: a readable message (OpenAI's error shape when the body has it), and which key a
 *  401 asks for: "caller" (the app's own 401, invalid_api_key) or "function" (the host's). */
async function httpError(response) {
  let text = `${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = await response.json();
    const error = body && body.error;
    if (error && typeof error.message === "string") {
      code = error.chatstream_kind || error.code || error.type; // the app's kind first, as in docs/api.md
      text = `${response.status}${code ? " " + code : ""}: ${error.message}`;
      if (error.param) text += ` (param: ${error.param})`;
    }
  } catch {
    // not JSON (e.g. the Functions host's empty 401): the status line says it
  }
  const retryAfter = response.headers.get("Retry-After");
  if (retryAfter) text += /^\d+$/.test(retryAfter) ? ` (Retry-After: ${retryAfter} s)` : ` (Retry-After: ${retryAfter})`;
  let wants = null;
  if (response.status === 401) {
    wants = code === "invalid_api_key" ? "caller" : "function";
    const where = wants === "caller" ? "a caller key: enter it under Caller key" : "its function key: enter it under Function key";
    text += `${/[.)]$/.test(text) ? "" : "."} This app needs ${where} and send again.`;
  }
  return { text, wants };
}

async function httpErrorMessage(response) {
  return (await httpError(response)).text;
}

function streamErrorMessage(error) {
  // The app's own kind first (chatstream_kind: the upstream's code may be in `code`), as docs/api.md names them.
  const kind = error && (error.chatstream_kind || error.code || error.type);
  const message = error && typeof error.message === "string" ? error.message : "the stream failed";
  return `Stream error: ${message}${kind ? ` (${kind})` : ""}`;
}

// ------------------------------------------------------------------ resumable streams

// When the app answers with `x-stream-id` (RESUMABLE_STREAMS=on), every event carries an `id:` and
// the stream outlives its connection: streams/ID with `Last-Event-ID: N` replays what came after
// event N and follows the rest; streams/ID/cancel stops it. While such a stream runs, the tab keeps
// in sessionStorage (one item, written at most every SAVE_EVERY_MS and when the page is hidden or
// unloaded) what a reload needs: the stream id, the id of the last event shown and the text shown up
// to that event, which are always written together, the question and the conversation before it.
const STREAM_ITEM = "chatstream.stream";
const STREAM_ID = /^[A-Za-z0-9_-]{16,128}$/;
const EVENT_ID = /^[0-9]{1,15}$/;
const SAVE_EVERY_MS = 250;
// The wait before each reconnection attempt. An attempt that brings new events starts the count
// again; when the last one fails too, the answer is left cut off. While the browser says it is offline,
// the page waits for it to be online again before it tries (that uses up no attempt).
const RECONNECT_DELAYS_MS = [250, 1000, 2000, 4000, 8000];
// Statuses of streams/ID worth another attempt; any other error status ends the turn.
const RETRY_STATUSES = new Set([408, 429, 500, 502, 503, 504]);
// After Stop, how long the page keeps reading for the stream's last event (finish_reason
// "cancelled") before it lets go of the connection; and how long the cancel call may take.
const STOP_WAIT_MS = 3000;
const CANCEL_TIMEOUT_MS = 5000;

function streamIdOf(response) {
  const id = response.headers.get("x-stream-id");
  return id !== null && STREAM_ID.test(id) ? id : null;
}

/** An event's id as a number, or null when it has none (or not a decimal one). */
function eventNumber(id) {
  return EVENT_ID.test(id) ? Number(id) : null;
}

/** An error event that ends one reading of a resumable stream, not the stream:
 *  `stream_store_unavailable` (the app could not read the stream from its store for a while) or
 *  `stream_moved` (the instance producing it stops; the stream goes on on another). */
const READER_ENDS = ["stream_store_unavailable", "stream_moved"];
function readerFailed(data) {
  if (!READER_ENDS.some((kind) => data.includes(kind))) return false;
  try {
    const error = JSON.parse(data).error;
    return Boolean(error) && READER_ENDS.some((kind) => error.code === kind || error.type === kind);
  } catch {
    return false;
  }
}

function streamUrl(streamId, action = "") {
  return `streams/${encodeURIComponent(streamId)}${action}`;
}

function isMessage(m) {
  return m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
}

/** What an earlier page of this tab kept of a stream it was reading, or null. */
function savedStream() {
  let saved;
  try {
    saved = JSON.parse(sessionStorage.getItem(STREAM_ITEM) || "null");
  } catch {
    return null;
  }
  const valid = saved && typeof saved === "object" && typeof saved.streamId === "string" && STREAM_ID.test(saved.streamId) &&
    Number.isSafeInteger(saved.lastEventId) && saved.lastEventId >= 0 && typeof saved.question === "string" &&
    typeof saved.answer === "string" && Number.isSafeInteger(saved.deltas) && Number.isSafeInteger(saved.reconnects) &&
    Array.isArray(saved.history) && saved.history.length % 2 === 0 && saved.history.every(isMessage);
  return valid ? saved : null;
}

function pause(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new DOMException("stopped", "AbortError"));
    const onAbort = () => {
      clearTimeout(timer);
      reject(new DOMException("stopped", "AbortError"));
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

/** Resolves at once when the browser is online, else when it is online again. */
function whenOnline(signal) {
  if (navigator.onLine) return Promise.resolve();
  return new Promise((resolve, reject) => {
    const online = () => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    };
    const onAbort = () => {
      window.removeEventListener("online", online);
      reject(new DOMException("stopped", "AbortError"));
    };
    window.addEventListener("online", online, { once: true });
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

/** Asks the app to stop a stream: true when it said yes (2xx). 404: unknown, expired or over. */
async function cancelStream(streamId) {
  const timeout = new AbortController();
  const timer = setTimeout(() => timeout.abort(), CANCEL_TIMEOUT_MS);
  try {
    const response = await fetch(streamUrl(streamId, "/cancel"), apiInit({ method: "POST", signal: timeout.signal }));
    return response.ok;
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

// ------------------------------------------------------------------ the page

function formatStats(turn) {
  const parts = [];
  // A turn picked up after a reload has no timings from before it: only its counts are shown.
  const timed = turn.timed && turn.firstAt !== null;
  if (timed) parts.push(`First delta ${Math.round(turn.firstAt - turn.startedAt)} ms`);
  if (timed && turn.deltas > 1 && turn.lastAt > turn.firstAt) {
    const rate = (turn.deltas - 1) / ((turn.lastAt - turn.firstAt) / 1000);
    parts.push(`${turn.deltas} deltas, ${rate.toFixed(1)}/s`);
  } else {
    parts.push(`${turn.deltas} ${turn.deltas === 1 ? "delta" : "deltas"}`);
  }
  if (turn.usage) parts.push(`tokens: ${turn.usage.prompt_tokens} prompt, ${turn.usage.completion_tokens} completion`);
  if (turn.reconnects > 0) parts.push(`reconnected ${turn.reconnects}×`);
  parts.push(`finish: ${turn.finish || "none"}`);
  return parts.join(" · ");
}

function main() {
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), temperature: $("temperature"), system: $("system"),
    keyBox: $("key-box"), key: $("key"), forgetKey: $("forget-key"), newChat: $("new-chat"),
    callerKeyBox: $("caller-key-box"), callerKey: $("caller-key"), forgetCallerKey: $("forget-caller-key"),
    modelsNote: $("models-note"), conversation: $("conversation"), empty: $("empty"), turns: $("turns"),
    questionBox: $("question-box"), question: $("question"), answerBox: $("answer-box"),
    answerWho: $("answer-who"), answer: $("answer"), note: $("answer-note"), stats: $("stats"),
    error: $("error"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  };

  const history = []; // earlier turns as chat messages: {role: "user" | "assistant", content}
  let current = null; // the turn on screen: {question, answer, state, ...}
  let controller = null; // aborts the running request (and the wait before the next attempt)
  let running = null; // the turn whose answer is being read
  let unloading = false; // the page is going away (reload, close): keep what a reload needs
  let follow = true; // keep the newest text in view, unless the reader scrolled up

  // -- keys (each only asked for when the API answers 401 for it)
  const keyFields = {
    function: { box: ui.keyBox, input: ui.key, forget: ui.forgetKey, item: KEY_ITEM },
    caller: { box: ui.callerKeyBox, input: ui.callerKey, forget: ui.forgetCallerKey, item: CALLER_ITEM },
  };
  function showKeyBox(which = "function") {
    keyFields[which].box.hidden = false;
    return keyFields[which].input;
  }
  for (const [which, field] of Object.entries(keyFields)) {
    if (stored(field.item)) {
      field.input.value = stored(field.item);
      showKeyBox(which);
    }
    const use = () => {
      if (field.input.value.trim() === stored(field.item)) return;
      store(field.item, field.input.value.trim());
      loadModels();
    };
    field.input.addEventListener("change", use);
    field.box.addEventListener("submit", (event) => {
      event.preventDefault(); // Enter in a key field: use it, and go back to the prompt
      use();
      ui.prompt.focus();
    });
    field.forget.addEventListener("click", () => {
      field.input.value = "";
      store(field.item, "");
    });
  }

  // -- models
  function fillModels(ids, note) {
    const chosen = ui.model.value;
    ui.model.replaceChildren();
    if (ids.length === 0) ui.model.append(new Option("app default", ""));
    for (const id of ids) ui.model.append(new Option(id, id));
    if (ids.includes(chosen)) ui.model.value = chosen;
    ui.modelsNote.textContent = note;
  }

  async function loadModels() {
    try {
      const response = await fetch("v1/models", apiInit());
      if (response.status === 401) {
        const { wants } = await httpError(response);
        showKeyBox(wants);
        fillModels([], `The API wants ${wants === "caller" ? "a caller key" : "the function key"}: enter it above.`);
        return;
      }
      if (!response.ok) {
        fillModels([], `Models: ${await httpErrorMessage(response)}`);
        return;
      }
      const body = await response.json();
      const ids = (Array.isArray(body.data) ? body.data : []).map((m) => m && m.id).filter((id) => typeof id === "string");
      fillModels(ids, "");
    } catch (err) {
      fillModels([], `Models: could not reach the app (${err.message}).`);
    }
  }

  // -- what is on screen
  function setBusy(busy) {
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
    ui.answerBox.classList.toggle("streaming", busy);
  }

  function showError(text) {
    ui.error.textContent = text;
    grown();
  }

  /** Content was added: scroll it into view if the reader is following along. */
  function grown() {
    if (follow) ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }
  ui.conversation.addEventListener("scroll", () => {
    const c = ui.conversation;
    follow = c.scrollHeight - c.scrollTop - c.clientHeight < 48;
  });

  function clearCurrent() {
    current = null;
    ui.question.textContent = "";
    ui.questionBox.hidden = true;
    ui.answer.replaceChildren();
    ui.answerWho.hidden = true;
    ui.answerBox.dataset.state = "";
    ui.note.textContent = "";
    ui.stats.textContent = "";
    showError("");
  }

  /** One message of the conversation: who said it, and its text (as text, never as HTML). */
  function messageElement(role, name, textContent) {
    const message = document.createElement("div");
    message.className = "msg " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = name;
    const text = document.createElement("div");
    text.className = "text";
    text.textContent = textContent;
    message.append(who, text);
    return message;
  }

  /** Moves the turn on screen, if it became part of the conversation, into the list above. */
  function archiveCurrent() {
    if (current && current.kept) {
      const item = document.createElement("li");
      item.className = "turn";
      const user = messageElement("user", "You", current.question);
      const assistant = messageElement("assistant", "Assistant", current.answer);
      assistant.dataset.state = current.state;
      const noteText = [ui.note.textContent, ui.error.textContent].filter(Boolean).join(" ");
      if (noteText) {
        const note = document.createElement("p");
        note.className = "note";
        note.textContent = noteText;
        assistant.append(note);
      }
      const stats = document.createElement("p");
      stats.className = "stats";
      stats.textContent = ui.stats.textContent;
      item.append(user, assistant, stats);
      ui.turns.append(item);
    }
    clearCurrent();
  }

  function newChat() {
    // A resumable stream goes on when the connection closes: the app is asked to stop it.
    if (running && running.streamId && !running.stopping) cancelStream(running.streamId);
    if (controller) controller.abort();
    history.length = 0;
    ui.turns.replaceChildren();
    clearCurrent();
    ui.empty.hidden = false;
    ui.prompt.focus();
  }

  function readTemperature() {
    const raw = ui.temperature.value.trim();
    if (raw === "" && !ui.temperature.validity.badInput) return undefined;
    const value = Number(raw);
    if (raw === "" || !Number.isFinite(value) || value < 0 || value > 2) {
      throw new Error("Temperature must be a number from 0 to 2 (or empty for the app's default).");
    }
    return value;
  }

  // -- one turn
  function newTurn(question) {
    return {
      question, answer: "", state: "streaming", kept: false, history: history.slice(),
      startedAt: performance.now(), timed: true, firstAt: null, lastAt: null, deltas: 0, usage: null, finish: null,
      streamId: null, lastEventId: 0, reconnects: 0, stopping: false, reading: false, stopTimer: null,
    };
  }

  async function send() {
    const text = ui.prompt.value;
    if (controller || text.trim() === "") return;
    let temperature;
    try {
      temperature = readTemperature();
    } catch (err) {
      showError(err.message);
      ui.temperature.focus();
      return;
    }
    archiveCurrent();
    ui.empty.hidden = true;

    const messages = [];
    if (ui.system.value.trim() !== "") messages.push({ role: "system", content: ui.system.value });
    messages.push(...history, { role: "user", content: text });
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (ui.model.value) body.model = ui.model.value;
    if (temperature !== undefined) body.temperature = temperature;

    const turn = newTurn(text);
    current = turn;
    ui.question.textContent = text;
    ui.questionBox.hidden = false;
    ui.answerWho.hidden = false;
    ui.prompt.value = "";
    follow = true;
    grown();

    await readAnswer(turn, (signal) => fetch("v1/chat/completions", apiInit({
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
      signal,
    })));
  }

  /** streams/ID from after the last event shown. */
  function resumeRequest(turn) {
    return (signal) => fetch(streamUrl(turn.streamId), apiInit({
      headers: { "last-event-id": String(turn.lastEventId) },
      signal,
    }));
  }

  /** Reads a turn's answer to its end: from the response of `request`, then, while the stream is
   *  resumable and its last event has not come, from streams/ID after each dropped connection. */
  async function readAnswer(turn, request) {
    controller = new AbortController();
    running = turn;
    const signal = controller.signal;
    setBusy(true);
    let ended = null; // "done" | "error" | null (the stream stopped without saying how)
    let failure = ""; // why the last connection of a resumable stream ended early
    let attempts = 0; // reconnection attempts since the last one that brought events
    try {
      while (true) {
        let response = null;
        try {
          response = await request(signal);
        } catch (err) {
          if (err.name === "AbortError" || !turn.streamId) throw err;
          failure = err.message;
        }
        if (response !== null && !response.ok) {
          if (!(turn.streamId && RETRY_STATUSES.has(response.status))) {
            const { text, wants } = await httpError(response);
            turn.state = turn.answer === "" ? "failed" : "cut-off";
            showError(turn.streamId ? `The answer could not be resumed: ${text}` : text);
            if (wants) showKeyBox(wants).focus();
            return;
          }
          failure = await httpErrorMessage(response);
        } else if (response !== null) {
          if (turn.streamId === null) {
            turn.streamId = streamIdOf(response);
            save(turn);
          }
          if (turn === current && !turn.stopping) ui.note.textContent = "";
          const before = turn.lastEventId;
          try {
            ended = await readEvents(response, turn);
          } catch (err) {
            if (err.name === "AbortError" || !turn.streamId) throw err;
            failure = err.message;
          }
          if (ended !== null || !turn.streamId) break;
          if (turn.lastEventId > before) attempts = 0;
          if (failure === "") failure = "the connection ended before the last event";
        }
        if (turn.stopping || attempts >= RECONNECT_DELAYS_MS.length) break;
        if (turn === current) ui.note.textContent = "Connection lost: reconnecting…";
        await pause(RECONNECT_DELAYS_MS[attempts], signal);
        if (!navigator.onLine) {
          if (turn === current) ui.note.textContent = "Offline: waiting for the network to reconnect…";
          await whenOnline(signal);
        }
        attempts += 1;
        turn.reconnects += 1;
        failure = "";
        request = resumeRequest(turn);
      }
      if (turn.stopping) {
        turn.state = "stopped";
      } else if (ended === "done") {
        turn.state = turn.finish === "cancelled" ? "stopped" : "done";
      } else {
        turn.state = "cut-off";
        if (ended === null && turn.streamId) {
          showError(`Stream error: the connection was lost and ${attempts} ${attempts === 1 ? "attempt" : "attempts"} ` +
                    `to reconnect failed (${failure}).`);
        } else if (ended === null) {
          showError("Stream error: the stream ended without its last event.");
        }
      }
    } catch (err) {
      if (err.name === "AbortError") {
        turn.state = "stopped";
      } else {
        turn.state = turn.deltas > 0 ? "cut-off" : "failed";
        showError(turn.deltas > 0 ? `Stream error: ${err.message}` : `Could not reach the app: ${err.message}`);
      }
    } finally {
      clearTimeout(turn.stopTimer);
      controller = null;
      running = null;
      if (!unloading) {
        forgetStream();
        setBusy(false);
        finishTurn(turn);
      }
    }
  }

  /** One connection's events, each shown once: returns "done", "error" or null (no last event). */
  async function readEvents(response, turn) {
    const reader = response.body.getReader();
    const parser = new SseParser();
    let ended = null;
    turn.reading = true;
    try {
      while (ended === null) {
        const { value, done } = await reader.read();
        const events = done ? parser.end() : parser.push(value);
        for (const event of events) {
          const id = turn.streamId ? eventNumber(event.id) : null;
          if (id !== null && id <= turn.lastEventId) continue; // shown already: a replay from too early
          if (turn.streamId && readerFailed(event.data)) {
            // Not the stream's end: the app could not read it from its store just now, or the stream
            // moved to another instance. It has no id; the next attempt asks again from the last one shown.
            throw new Error("this reading of the stream ended; resuming it");
          }
          ended = handle(event.data, turn);
          if (id !== null) turn.lastEventId = id;
          if (ended !== null) break;
        }
        if (events.length > 0) saveSoon(turn);
        if (done) break;
      }
    } finally {
      turn.reading = false;
    }
    if (ended !== null) reader.cancel().catch(() => {});
    return ended;
  }

  // -- what a reload needs (see STREAM_ITEM)
  let saveTimer = null;

  function save(turn) {
    if (!turn.streamId || turn.stopping) return;
    store(STREAM_ITEM, JSON.stringify({
      streamId: turn.streamId, lastEventId: turn.lastEventId, answer: turn.answer, question: turn.question,
      history: turn.history, deltas: turn.deltas, usage: turn.usage, finish: turn.finish, reconnects: turn.reconnects,
    }));
  }

  function saveSoon(turn) {
    if (!turn.streamId || saveTimer !== null) return;
    saveTimer = setTimeout(() => {
      saveTimer = null;
      if (running === turn) save(turn);
    }, SAVE_EVERY_MS);
  }

  function forgetStream() {
    clearTimeout(saveTimer);
    saveTimer = null;
    store(STREAM_ITEM, "");
  }

  window.addEventListener("pagehide", () => {
    unloading = true;
    if (running) save(running);
  });
  window.addEventListener("pageshow", (event) => {
    if (event.persisted) unloading = false;
  });
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "hidden" && running) save(running);
  });

  /** After a reload mid-answer: the conversation and the question back on screen, with the text
   *  shown so far, and the stream followed from the last event shown. */
  function resumeSaved() {
    const saved = savedStream();
    if (saved === null) {
      forgetStream();
      return;
    }
    for (let i = 0; i < saved.history.length; i += 2) {
      const item = document.createElement("li");
      item.className = "turn";
      item.append(messageElement("user", "You", saved.history[i].content),
                  messageElement("assistant", "Assistant", saved.history[i + 1].content));
      ui.turns.append(item);
    }
    history.push(...saved.history);
    ui.empty.hidden = true;
    const turn = newTurn(saved.question);
    Object.assign(turn, {
      answer: saved.answer, deltas: saved.deltas, usage: saved.usage || null, finish: saved.finish || null,
      streamId: saved.streamId, lastEventId: saved.lastEventId, reconnects: saved.reconnects + 1, timed: false,
    });
    current = turn;
    ui.question.textContent = turn.question;
    ui.questionBox.hidden = false;
    ui.answerWho.hidden = false;
    ui.answer.append(document.createTextNode(turn.answer)); // text, never markup
    ui.note.textContent = "Reconnecting…";
    grown();
    readAnswer(turn, resumeRequest(turn));
  }

  /** Stop: a resumable stream is cancelled by the app (a hang-up would not stop it), and read to its
   *  last event (finish_reason "cancelled") for a moment; the text on screen stays as it was. Any
   *  other stream, or a second Stop, aborts the request. */
  function stop() {
    const turn = running;
    if (!controller) return;
    if (!turn || !turn.streamId || turn.stopping) {
      controller.abort();
      return;
    }
    turn.stopping = true;
    forgetStream();
    if (turn === current) ui.note.textContent = "Stopping…";
    const request = controller;
    cancelStream(turn.streamId).then((cancelled) => {
      if (controller !== request) return; // over meanwhile
      if (!cancelled || !turn.reading) request.abort();
      else turn.stopTimer = setTimeout(() => request.abort(), STOP_WAIT_MS);
    });
  }

  /** One event's data: returns "done", "error", or null (more to come). */
  function handle(data, turn) {
    if (data === "[DONE]") return "done";
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch {
      showError("Stream error: the app sent an event that is not JSON.");
      return "error";
    }
    if (chunk && chunk.error) {
      showError(streamErrorMessage(chunk.error));
      return "error";
    }
    if (chunk && chunk.usage) turn.usage = chunk.usage;
    for (const choice of (chunk && Array.isArray(chunk.choices)) ? chunk.choices : []) {
      if ((choice.index || 0) !== 0) continue;
      const content = choice.delta && choice.delta.content;
      if (typeof content === "string" && content !== "") append(content, turn);
      if (choice.finish_reason) turn.finish = choice.finish_reason;
    }
    return null;
  }

  function append(text, turn) {
    if (turn !== current || turn.stopping) return; // after Stop the text stays as it was
    const now = performance.now();
    if (turn.firstAt === null) turn.firstAt = now;
    turn.lastAt = now;
    turn.deltas += 1;
    turn.answer += text;
    ui.answer.append(document.createTextNode(text)); // text, never markup
    grown();
  }

  function finishTurn(turn) {
    if (turn !== current) return; // "New chat" cleared it meanwhile
    ui.answerBox.dataset.state = turn.state;
    const notes = { "cut-off": "Cut off: the answer is incomplete.", stopped: "Stopped." };
    ui.note.textContent = notes[turn.state] || "";
    if (turn.state !== "failed") ui.stats.textContent = formatStats(turn);
    // A turn with text becomes part of the conversation, also when cut off or stopped (the model
    // is then told what was shown); one without gives its prompt back for another try.
    if (turn.answer !== "" || turn.state === "done") {
      turn.kept = true;
      history.push({ role: "user", content: turn.question }, { role: "assistant", content: turn.answer });
    } else {
      if (ui.prompt.value === "") ui.prompt.value = turn.question;
      ui.questionBox.hidden = true;
      ui.answerWho.hidden = true;
    }
    if (document.activeElement === ui.stop || document.activeElement === document.body) ui.prompt.focus();
    grown();
  }

  // -- controls
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape" && controller) {
      stop();
    }
  });
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);

  loadModels();
  resumeSaved();
}

main();
