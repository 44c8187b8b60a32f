// The chat playground: talks to this app's own OpenAI-compatible API with relative URLs
// (v1/models, v1/chat/completions), reads the streamed answer with fetch + ReadableStream and a
// small server-sent-events parser, and shows it as text: the model's text only ever goes into text
// nodes, never into HTML.
"use strict";

// ------------------------------------------------------------------ server-sent events

/** Bytes in, events out. Lines may end in CRLF, CR or LF; a read may end inside a line, between a
 *  CR and its LF, or inside a multi-byte UTF-8 character. Comments (":") are skipped; an event
 *  without a terminating blank line when the stream ends is dropped, as the EventSource rules say. */
class SseParser {
  constructor() {
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.skipLF = false; // the last read ended with CR: a LF starting the next one belongs to it
    this.data = [];
    this.event = "";
  }

  /** Feed one read's bytes; returns the events completed by them: [{event, data}]. */
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
      if (this.data.length > 0) events.push({ event: this.event || "message", data: this.data.join("\n") });
      this.data = [];
      this.event = "";
      return;
    }
    if (line[0] === ":") return;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value[0] === " ") value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
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
      code = error.code || error.type;
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
  const kind = error && (error.code || error.type);
  const message = error && typeof error.message === "string" ? error.message : "the stream failed";
  return `Stream error: ${message}${kind ? ` (${kind})` : ""}`;
}

// ------------------------------------------------------------------ the page

function formatStats(turn) {
  const parts = [];
  if (turn.firstAt !== null) parts.push(`First delta ${Math.round(turn.firstAt - turn.startedAt)} ms`);
  if (turn.deltas > 1 && turn.lastAt > turn.firstAt) {
    const rate = (turn.deltas - 1) / ((turn.lastAt - turn.firstAt) / 1000);
    parts.push(`${turn.deltas} deltas, ${rate.toFixed(1)}/s`);
  } else {
    parts.push(`${turn.deltas} ${turn.deltas === 1 ? "delta" : "deltas"}`);
  }
  if (turn.usage) parts.push(`tokens: ${turn.usage.prompt_tokens} prompt, ${turn.usage.completion_tokens} completion`);
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
  let controller = null; // aborts the running request
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

    const turn = {
      question: text, answer: "", state: "streaming", kept: false,
      startedAt: performance.now(), firstAt: null, lastAt: null, deltas: 0, usage: null, finish: null,
    };
    current = turn;
    ui.question.textContent = text;
    ui.questionBox.hidden = false;
    ui.answerWho.hidden = false;
    ui.prompt.value = "";
    follow = true;
    grown();

    controller = new AbortController();
    setBusy(true);
    let ended = null; // "done" | "error" | null (the stream stopped without saying how)
    try {
      const response = await fetch("v1/chat/completions", apiInit({
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      }));
      if (!response.ok) {
        turn.state = "failed";
        const { text, wants } = await httpError(response);
        showError(text);
        if (wants) showKeyBox(wants).focus();
        return;
      }
      const reader = response.body.getReader();
      const parser = new SseParser();
      while (ended === null) {
        const { value, done } = await reader.read();
        const events = done ? parser.end() : parser.push(value);
        for (const event of events) {
          ended = handle(event.data, turn);
          if (ended !== null) break;
        }
        if (done) break;
      }
      if (ended !== null) reader.cancel().catch(() => {});
      if (ended === "done") {
        turn.state = "done";
      } else {
        turn.state = "cut-off";
        if (ended === null) showError("Stream error: the stream ended without its last event.");
      }
    } catch (err) {
      if (err.name === "AbortError") {
        turn.state = "stopped";
      } else {
        turn.state = turn.deltas > 0 ? "cut-off" : "failed";
        showError(turn.deltas > 0 ? `Stream error: ${err.message}` : `Could not reach the app: ${err.message}`);
      }
    } finally {
      controller = null;
      setBusy(false);
      finishTurn(turn);
    }
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
    if (turn !== current) return;
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
      controller.abort();
    }
  });
  ui.stop.addEventListener("click", () => {
    if (controller) controller.abort();
  });
  ui.newChat.addEventListener("click", newChat);

  loadModels();
}

main();
