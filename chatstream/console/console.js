// The operators' console: drives this app's admin API (manage/callers, manage/teams, manage/prices,
// manage/usage) with relative URLs. Everything the API returns only ever becomes text (text nodes,
// attributes set one by one), never HTML; the charts are SVG drawn here. The host's master key, when
// the API asks for one (401), is kept in this tab's sessionStorage and sent only as x-functions-key.
"use strict";

// ------------------------------------------------------------------ small helpers

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";

/** An element with attributes (set one by one; "text" is its text) and children (strings become text). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  return fill(node, attrs, children);
}

function svgEl(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

function fill(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.setAttribute("class", value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const compact = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

function tokens(n) {
  return integer.format(n || 0);
}

/** USD: cents when there are any, up to 6 decimals below a cent (a request can cost $0.000012). */
function usd(n) {
  n = n || 0;
  const digits = n !== 0 && Math.abs(n) < 0.01 ? 6 : 2;
  return "$" + n.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: digits });
}

function usdAxis(n) {
  if (n === 0) return "$0";
  if (n >= 1000) return "$" + compact.format(n);
  return "$" + Number(n.toPrecision(3)).toString();
}

function percent(part, whole) {
  if (!whole) return 0;
  return Math.min(100, (100 * part) / whole);
}

function when(iso) {
  return iso ? iso.replace("T", " ").replace(/:\d\d(\.\d+)?Z$/, " UTC") : "";
}

// ------------------------------------------------------------------ the admin API

const KEY_ITEM = "chatstream.masterKey";

function storedKey() {
  try {
    return sessionStorage.getItem(KEY_ITEM) || "";
  } catch {
    return "";
  }
}

function storeKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_ITEM, key);
    else sessionStorage.removeItem(KEY_ITEM);
  } catch {
    // storage refused (private mode): the key is then not kept at all
  }
}

class ApiError extends Error {
  constructor(status, code, param, message) {
    super(message);
    this.status = status;
    this.code = code;
    this.param = param;
  }
}

/** One call to the admin API; a non-2xx answer throws an ApiError with the API's message. */
async function api(path, { method = "GET", body, accept } = {}) {
  const headers = {};
  const key = storedKey();
  if (key) headers["x-functions-key"] = key;
  if (body !== undefined) headers["content-type"] = "application/json";
  if (accept) headers.accept = accept;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "same-origin",
      redirect: "error",
    });
  } catch (error) {
    throw new ApiError(0, "network", null, `The app did not answer (${error.message}).`);
  }
  if (response.ok) return response;
  let error = {};
  try {
    const parsed = await response.json();
    if (parsed && typeof parsed.error === "object" && parsed.error) error = parsed.error;
  } catch {
    // not JSON (the Functions host's own 401 has no body)
  }
  const status = response.status;
  const code = error.code || error.type || null;
  let message = typeof error.message === "string" ? error.message : response.statusText || "the request failed";
  if (status === 401 || status === 403) {
    message = key
      ? "the master key was refused. Check it (az functionapp keys list … --query masterKey) and enter it again."
      : "the admin API needs the host's master key: enter it under Master key.";
    showKeyBox();
  }
  return Promise.reject(new ApiError(status, code, error.param || null, message));
}

async function apiJson(path, options) {
  return (await api(path, options)).json();
}

/** "STATUS code: message", as the API said it. */
function describe(error) {
  if (!(error instanceof ApiError)) return `Something went wrong in this page: ${error && error.message}`;
  if (error.status === 0) return error.message;
  return `${error.status}${error.code ? " " + error.code : ""}: ${error.message}`;
}

function showKeyBox() {
  $("key-box").hidden = false;
}

// ------------------------------------------------------------------ the banner (errors of a view)

let retryView = null;

function showError(error, retry) {
  $("error").textContent = describe(error);
  $("banner").hidden = false;
  retryView = retry || null;
  $("retry").hidden = !retry;
}

function clearError() {
  $("error").textContent = "";
  $("banner").hidden = true;
}

// ------------------------------------------------------------------ tabs

const VIEWS = { callers: loadCallers, prices: loadPrices, usage: loadUsage };
let current = "callers";

function select(view) {
  if (!VIEWS[view]) view = "callers";
  current = view;
  for (const name of Object.keys(VIEWS)) {
    const tab = $("tab-" + name);
    tab.setAttribute("aria-selected", String(name === view));
    tab.tabIndex = name === view ? 0 : -1;
    $("view-" + name).hidden = name !== view;
  }
  if (location.hash !== "#" + view) history.replaceState(null, "", "#" + view);
  return refresh();
}

function refresh() {
  clearError();
  const view = current;
  return VIEWS[view]().catch((error) => showError(error, () => select(view)));
}

// ------------------------------------------------------------------ teams and callers

let teams = [];
let callers = [];

async function loadCallers() {
  const [t, c] = await Promise.all([apiJson("manage/teams"), apiJson("manage/callers")]);
  teams = t.data;
  callers = c.data;
  renderTeams();
  renderCallers();
}

function limitsText(o) {
  const parts = [];
  if (o.tokens_per_minute) parts.push(`${tokens(o.tokens_per_minute)} tokens/min`);
  if (o.requests_per_minute) parts.push(`${tokens(o.requests_per_minute)} requests/min`);
  for (const [model, limit] of Object.entries(o.model_limits || {})) {
    const each = [];
    if (limit.tokens_per_minute) each.push(`${tokens(limit.tokens_per_minute)} tokens/min`);
    if (limit.requests_per_minute) each.push(`${tokens(limit.requests_per_minute)} requests/min`);
    parts.push(`${model}: ${each.join(", ")}`);
  }
  return parts.length ? parts.join(" · ") : "no limit";
}

const PERIODS = { day: "today (UTC)", month: "this month (UTC)", total: "in total" };

/** One bar: how much of a budget is taken this period. */
function bar(label, used, limit, format) {
  const share = percent(used, limit);
  const fillBar = el("span", { class: "fill" });
  fillBar.style.width = share > 0 ? `max(2px, ${share.toFixed(2)}%)` : "0"; // CSSOM, not a style attribute: the CSP allows it
  const shareText = share > 0 && share < 0.1 ? "<0.1%" : share.toFixed(share < 10 ? 1 : 0) + "%";
  return el(
    "div",
    { class: "budget" + (share >= 100 ? " full" : share >= 80 ? " near" : "") },
    el(
      "span",
      {
        class: "track",
        role: "meter",
        "aria-label": label,
        "aria-valuemin": 0,
        "aria-valuemax": limit,
        "aria-valuenow": Math.min(used, limit),
        "aria-valuetext": `${format(used)} of ${format(limit)}`,
      },
      fillBar,
    ),
    el("span", { class: "amount", text: `${format(used)} of ${format(limit)} (${shareText})` }),
  );
}

function budgetCell(o, kind) {
  const cell = el("td", { class: "budgets" });
  if (o.token_budget) cell.append(bar(`Token budget of ${kind} ${o.name}`, o.token_budget_used || 0, o.token_budget, tokens));
  if (o.spend_budget) cell.append(bar(`Spend budget of ${kind} ${o.name}`, o.spend_budget_used || 0, o.spend_budget, usd));
  if (o.token_budget || o.spend_budget) cell.append(el("span", { class: "hint", text: PERIODS[o.budget_period] || "" }));
  else cell.append(el("span", { class: "hint", text: "no budget" }));
  return cell;
}

function actions(...buttons) {
  return el("td", { class: "row-actions" }, ...buttons);
}

function button(text, label, onClick, cls) {
  const b = el("button", { type: "button", class: cls || "quiet", "aria-label": label, text });
  b.addEventListener("click", onClick);
  return b;
}

function emptyRow(table, text) {
  const columns = $(table).tHead.rows[0].cells.length;
  return el("tr", { class: "empty" }, el("td", { colspan: columns, text }));
}

/** A row the app cannot read (a hand edit in the store): its name, why, and the way out: delete it. */
function unreadableRow(table, o, remove) {
  const columns = $(table).tHead.rows[0].cells.length;
  return el(
    "tr",
    { class: "unreadable" },
    el("th", { scope: "row", text: o.name }),
    el("td", { colspan: columns - 2, text: `Unreadable (${o.unreadable}): its requests are refused. Delete it, then create it again.` }),
    actions(remove),
  );
}

function renderTeams() {
  const body = $("teams").tBodies[0];
  const rows = teams.map((t) => {
    if (t.unreadable) return unreadableRow("teams", t, button("Delete", `Delete team ${t.name}`, () => confirmDeleteTeam(t)));
    const members = callers.filter((c) => c.team === t.name).length;
    return el(
      "tr",
      {},
      el("th", { scope: "row", text: t.name }),
      el("td", { text: String(members) }),
      el("td", { text: limitsText(t) }),
      budgetCell(t, "team"),
      el("td", { text: t.models ? t.models.join(", ") : "any" }),
      actions(
        button("Edit", `Edit team ${t.name}`, () => openEditor("team", t)),
        button("Delete", `Delete team ${t.name}`, () => confirmDeleteTeam(t)),
      ),
    );
  });
  body.replaceChildren(...(rows.length ? rows : [emptyRow("teams", "No teams yet.")]));
}

function renderCallers() {
  const body = $("callers").tBodies[0];
  const now = Date.now();
  const rows = callers.map((c) => {
    if (c.unreadable) return unreadableRow("callers", c, button("Delete", `Delete caller ${c.name}`, () => confirmDeleteCaller(c)));
    const expired = c.expires_at && Date.parse(c.expires_at) <= now;
    return el(
      "tr",
      { "data-caller": c.name },
      el("th", { scope: "row", text: c.name }),
      el("td", { text: c.team || "–" }),
      el("td", { text: limitsText(c) + (c.models ? ` · models: ${c.models.join(", ")}` : "") }),
      budgetCell(c, "caller"),
      el("td", { class: expired ? "expired" : "", text: c.expires_at ? when(c.expires_at) + (expired ? " (expired)" : "") : "never" }),
      el("td", {}, el("code", { text: "…" + c.key_hint })),
      actions(
        button("Edit", `Edit caller ${c.name}`, () => openEditor("caller", c)),
        button("Rotate key", `Rotate the key of ${c.name}`, () => confirmRotate(c)),
        button("Delete", `Delete caller ${c.name}`, () => confirmDeleteCaller(c)),
      ),
    );
  });
  body.replaceChildren(...(rows.length ? rows : [emptyRow("callers", "No callers yet.")]));
}

// --- the editor (create or change a team or a caller)

const FIELDS = [
  "name",
  "team",
  "tokens_per_minute",
  "requests_per_minute",
  "token_budget",
  "spend_budget",
  "budget_period",
  "expires_at",
  "models",
  "model_limits",
];
const NUMBERS = ["tokens_per_minute", "requests_per_minute", "token_budget", "spend_budget"];
let editing = null; // {kind: "team" | "caller", original: the object, or null for a new one}

function input(field) {
  return $("f-" + field);
}

/** An object's field as the form shows it. */
function shown(o, field) {
  const value = o ? o[field] : null;
  if (field === "budget_period") return value || "total";
  if (value === null || value === undefined) return "";
  if (field === "models") return value.join(", ");
  if (field === "model_limits") return JSON.stringify(value);
  if (field === "expires_at") return value.slice(0, 16);
  return String(value);
}

/** A field's value as the API takes it; throws [field, message] for what the API could not read. */
function parsed(field) {
  const box = input(field);
  const text = box.value.trim();
  if (NUMBERS.includes(field)) {
    if (box.validity.badInput) throw [field, "not a number"];
    return text === "" ? null : Number(text);
  }
  if (text === "") return field === "budget_period" ? "total" : null;
  if (field === "models") return text.split(/[,\n]/).map((m) => m.trim()).filter(Boolean);
  if (field === "model_limits") {
    try {
      return JSON.parse(text);
    } catch (error) {
      throw [field, `not JSON: ${error.message}`];
    }
  }
  if (field === "expires_at") return (text.length === 16 ? text + ":00" : text) + "Z";
  return text;
}

function openEditor(kind, original) {
  editing = { kind, original };
  $("editor-title").textContent = original ? `Edit ${kind} ${original.name}` : `New ${kind}`;
  for (const row of document.querySelectorAll("#editor .field")) {
    row.hidden = row.dataset.for === "caller" && kind !== "caller";
  }
  const team = input("team");
  team.replaceChildren(el("option", { value: "", text: "(no team)" }), ...teams.filter((t) => !t.unreadable).map((t) => el("option", { value: t.name, text: t.name })));
  for (const field of FIELDS) {
    input(field).value = shown(original, field);
    input(field).dataset.initial = input(field).value;
  }
  input("name").readOnly = Boolean(original);
  clearFieldErrors();
  $("editor-save").textContent = original ? "Save" : `Create ${kind}`;
  $("editor").showModal();
  (original ? input("tokens_per_minute") : input("name")).focus();
}

function clearFieldErrors() {
  for (const note of document.querySelectorAll("#editor .field-error")) note.remove();
  for (const box of document.querySelectorAll("#editor [aria-invalid]")) {
    box.removeAttribute("aria-invalid");
    box.removeAttribute("aria-describedby");
  }
  $("editor-error").textContent = "";
}

/** The API's message next to the field it names (param), or under the form when it names none shown. */
function fieldError(field, message) {
  const row = document.querySelector(`#editor .field[data-param="${field}"]`);
  if (!row || row.hidden) {
    $("editor-error").textContent = message;
    return;
  }
  const note = el("p", { class: "field-error", id: `f-${field}-error`, text: message });
  row.append(note);
  input(field).setAttribute("aria-invalid", "true");
  input(field).setAttribute("aria-describedby", note.id);
  input(field).focus();
}

async function saveEditor(event) {
  event.preventDefault();
  clearFieldErrors();
  const { kind, original } = editing;
  const body = {};
  try {
    for (const field of FIELDS) {
      if (input(field).closest(".field").hidden) continue;
      if (original && (field === "name" || input(field).value === input(field).dataset.initial)) continue;
      const value = parsed(field);
      if (original || value !== null) body[field] = value;
    }
  } catch (problem) {
    if (!Array.isArray(problem)) throw problem;
    fieldError(...problem);
    return;
  }
  const path = `manage/${kind === "team" ? "teams" : "callers"}`;
  $("editor-save").disabled = true;
  try {
    const answer = original
      ? await apiJson(`${path}/${encodeURIComponent(original.name)}`, { method: "PATCH", body })
      : await apiJson(path, { method: "POST", body });
    $("editor").close();
    if (answer.key) showNewKey(answer.name, answer.key);
    await refresh();
  } catch (error) {
    if (error instanceof ApiError && error.param) fieldError(error.param, error.message);
    else $("editor-error").textContent = describe(error);
  } finally {
    $("editor-save").disabled = false;
  }
}

// --- confirmations (delete, rotate)

let confirmed = null;

function ask(title, text, yes, action) {
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-yes").textContent = yes;
  $("confirm-error").textContent = "";
  confirmed = action;
  $("confirm").showModal();
}

async function runConfirmed(event) {
  event.preventDefault();
  $("confirm-yes").disabled = true;
  try {
    await confirmed();
    $("confirm").close();
    await refresh();
  } catch (error) {
    $("confirm-error").textContent = describe(error);
  } finally {
    $("confirm-yes").disabled = false;
  }
}

function confirmDeleteCaller(c) {
  ask(`Delete caller ${c.name}?`, "Its key stops working on every instance within seconds. Its usage stays in the ledger.", "Delete caller", () =>
    api(`manage/callers/${encodeURIComponent(c.name)}`, { method: "DELETE" }),
  );
}

function confirmDeleteTeam(t) {
  ask(`Delete team ${t.name}?`, "A team that still has callers is not deleted: move or delete them first.", "Delete team", () =>
    api(`manage/teams/${encodeURIComponent(t.name)}`, { method: "DELETE" }),
  );
}

function confirmRotate(c) {
  ask(`Rotate the key of ${c.name}?`, "A new key is made and shown once; the current key stops working on every instance within seconds.", "Rotate key", async () => {
    const answer = await apiJson(`manage/callers/${encodeURIComponent(c.name)}/rotate`, { method: "POST" });
    showNewKey(answer.name, answer.key);
  });
}

// --- a new key, shown this once

function showNewKey(name, key) {
  $("new-key-title").textContent = `The key of ${name}`;
  $("key-value").value = key;
  $("copy-note").textContent = "";
  $("new-key").showModal();
  $("key-value").select();
}

async function copyKey() {
  const box = $("key-value");
  try {
    await navigator.clipboard.writeText(box.value);
  } catch {
    box.select();
    if (!document.execCommand("copy")) {
      $("copy-note").textContent = "Copying is not allowed here: select the key and copy it yourself.";
      return;
    }
  }
  $("copy-note").textContent = "Copied.";
}

function forgetNewKey() {
  $("key-value").value = ""; // gone from the page: never shown again
  $("copy-note").textContent = "";
}

// ------------------------------------------------------------------ prices

const PRICE_FIELDS = ["input", "cached_input", "output"];

async function loadPrices() {
  const prices = (await apiJson("manage/prices")).data;
  const rows = prices.map((p) => priceRow(p));
  rows.push(priceRow(null));
  $("prices").tBodies[0].replaceChildren(...rows);
}

function priceInput(field, label, value) {
  const box = el("input", { type: "number", min: 0, step: "any", "aria-label": label, value: value === null || value === undefined ? "" : value });
  return el("td", { "data-param": field }, box);
}

/** A price as a row of inputs (editable in place); null: the row that adds a model. */
function priceRow(p) {
  const name = p ? p.model : "new model";
  const model = p
    ? el("th", { scope: "row", "data-param": "model" }, el("span", { text: p.model }))
    : el("td", { "data-param": "model" }, el("input", { type: "text", "aria-label": "Model", placeholder: "model name", spellcheck: "false" }));
  const cells = PRICE_FIELDS.map((f) =>
    priceInput(f, `${{ input: "Input", cached_input: "Cached input", output: "Output" }[f]} price of ${name}`, p ? p[f] : null),
  );
  const updated = p && p.unreadable ? `Unreadable (${p.unreadable}): save a price or delete it` : p ? when(p.updated_at) : "";
  const row = el("tr", p && p.unreadable ? { class: "unreadable" } : {}, model, ...cells, el("td", { class: "hint", text: updated }));
  const save = button(p ? "Save" : "Add price", p ? `Save the price of ${p.model}` : "Add price", () => savePrice(row, p), p ? "quiet" : "primary");
  const buttons = [save];
  if (p) {
    buttons.push(
      button("Delete", `Delete the price of ${p.model}`, () =>
        ask(`Delete the price of ${p.model}?`, "Requests for it are then charged their tokens and no money (counted as unpriced).", "Delete price", () =>
          api(`manage/prices/${modelPath(p.model)}`, { method: "DELETE" }),
        ),
      ),
    );
  }
  row.append(actions(...buttons));
  return row;
}

function modelPath(model) {
  return model.split("/").map(encodeURIComponent).join("/");
}

async function savePrice(row, p) {
  for (const note of row.querySelectorAll(".field-error")) note.remove();
  const model = p ? p.model : row.querySelector('[data-param="model"] input').value.trim();
  const body = {};
  const error = (field, message) => {
    const cell = row.querySelector(`[data-param="${field}"]`) || row.lastElementChild;
    const note = el("p", { class: "field-error", text: message });
    cell.append(note);
  };
  if (!model) return error("model", "model: a model name is needed");
  for (const field of PRICE_FIELDS) {
    const box = row.querySelector(`[data-param="${field}"] input`);
    if (box.validity.badInput) return error(field, `${field}: not a number`);
    if (box.value.trim() !== "") body[field] = Number(box.value);
  }
  try {
    await api(`manage/prices/${modelPath(model)}`, { method: "PUT", body });
    await refresh();
  } catch (e) {
    if (e instanceof ApiError && e.param && row.querySelector(`[data-param="${e.param}"]`)) error(e.param, e.message);
    else error(null, describe(e));
  }
}

// ------------------------------------------------------------------ usage

const COLORS = ["#2456c8", "#e07b00", "#1b9e77", "#c2185b", "#7b5cd6", "#8c6d1f", "#0097a7", "#6b7280"];
const MAX_SERIES = 7; // and "other"
const DAY = 86400000;

function isoDay(ms) {
  return new Date(ms).toISOString().slice(0, 10);
}

/** The preset's from and to (UTC days). */
function presetPeriod(preset) {
  const today = new Date();
  const t = Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), today.getUTCDate());
  if (preset === "month") return [isoDay(Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), 1)), isoDay(t)];
  if (preset === "last-month") {
    const first = Date.UTC(today.getUTCFullYear(), today.getUTCMonth() - 1, 1);
    return [isoDay(first), isoDay(Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), 1) - DAY)];
  }
  return [isoDay(t - (Number(preset) - 1) * DAY), isoDay(t)];
}

function usageQuery() {
  return `from=${encodeURIComponent($("from").value)}&to=${encodeURIComponent($("to").value)}`;
}

let lastUsage = null;

async function loadUsage() {
  if (!$("from").value || !$("to").value) [$("from").value, $("to").value] = presetPeriod($("period").value);
  $("usage-total").textContent = "Loading…";
  let usage, answered;
  try {
    const response = await api(`manage/usage?${usageQuery()}`);
    answered = performance.now(); // the body's download and parsing count as rendering
    usage = await response.json();
  } catch (error) {
    $("usage-total").textContent = "";
    throw error;
  }
  lastUsage = usage;
  renderUsage(answered);
}

function stackBy() {
  return document.querySelector('input[name="by"]:checked').value;
}

function renderUsage(started = performance.now()) {
  const usage = lastUsage;
  const by = stackBy();
  const days = [];
  for (let t = Date.parse(usage.from); t <= Date.parse(usage.to); t += DAY) days.push(isoDay(t));
  const index = new Map(days.map((d, i) => [d, i]));
  // per series: spend and tokens per day; per caller: the sums for the top table
  const series = new Map();
  const perCaller = new Map();
  for (const row of usage.data) {
    const name = (by === "team" ? row.team : row.model) || (by === "team" ? "(no team)" : "(no model)");
    let s = series.get(name);
    if (!s) series.set(name, (s = { name, spend: new Float64Array(days.length), tokens: new Float64Array(days.length), total: 0, totalTokens: 0 }));
    const i = index.get(row.day);
    if (i === undefined) continue;
    s.spend[i] += row.cost_usd;
    s.tokens[i] += row.total_tokens;
    s.total += row.cost_usd;
    s.totalTokens += row.total_tokens;
    let c = perCaller.get(row.caller);
    if (!c) perCaller.set(row.caller, (c = { name: row.caller, team: row.team, requests: 0, tokens: 0, spend: 0 }));
    c.requests += row.requests;
    c.tokens += row.total_tokens;
    c.spend += row.cost_usd;
  }
  let ordered = [...series.values()].sort((a, b) => b.total - a.total || b.totalTokens - a.totalTokens || (a.name < b.name ? -1 : 1));
  if (ordered.length > MAX_SERIES + 1) {
    const other = { name: "other", spend: new Float64Array(days.length), tokens: new Float64Array(days.length), total: 0, totalTokens: 0 };
    for (const s of ordered.slice(MAX_SERIES)) {
      for (let i = 0; i < days.length; i++) {
        other.spend[i] += s.spend[i];
        other.tokens[i] += s.tokens[i];
      }
      other.total += s.total;
      other.totalTokens += s.totalTokens;
    }
    ordered = [...ordered.slice(0, MAX_SERIES), other];
  }
  ordered.forEach((s, i) => (s.color = COLORS[i % COLORS.length]));
  const total = usage.total;
  const what = by === "team" ? "team" : "model";
  drawChart($("chart-spend"), days, ordered, "spend", usd, usdAxis, `Spend per day by ${what}, ${usage.from} to ${usage.to}: ${usd(total.cost_usd)} in total`);
  drawChart($("chart-tokens"), days, ordered, "tokens", tokens, (n) => compact.format(n), `Tokens per day by ${what}, ${usage.from} to ${usage.to}: ${tokens(total.total_tokens)} in total`);
  $("legend").replaceChildren(
    ...ordered.map((s) => {
      const swatch = el("span", { class: "swatch", "aria-hidden": "true" });
      swatch.style.background = s.color;
      return el("li", {}, swatch, `${s.name}: ${usd(s.total)}, ${tokens(s.totalTokens)} tokens`);
    }),
  );
  renderTop([...perCaller.values()], total.cost_usd);
  let line = `${usage.from} to ${usage.to}: ${usd(total.cost_usd)} · ${tokens(total.total_tokens)} tokens · ${tokens(total.requests)} requests`;
  if (total.unpriced_requests) line += ` · ${tokens(total.unpriced_requests)} requests for models without a price (no spend counted: see Prices)`;
  $("usage-total").textContent = line;
  // How long from the answer in hand to the view on screen (the frame after the one it was drawn in).
  const chart = $("chart-spend");
  delete chart.dataset.renderMs;
  requestAnimationFrame(() => requestAnimationFrame(() => (chart.dataset.renderMs = (performance.now() - started).toFixed(1))));
}

function renderTop(all, totalSpend) {
  const top = all.sort((a, b) => b.spend - a.spend || b.tokens - a.tokens || (a.name < b.name ? -1 : 1)).slice(0, 10);
  const rows = top.map((c) => {
    const share = percent(c.spend, totalSpend);
    const fillBar = el("span", { class: "fill" });
    fillBar.style.width = share.toFixed(1) + "%";
    return el(
      "tr",
      {},
      el("th", { scope: "row", text: c.name }),
      el("td", { text: c.team || "–" }),
      el("td", { class: "num", text: tokens(c.requests) }),
      el("td", { class: "num", text: tokens(c.tokens) }),
      el("td", { class: "num", text: usd(c.spend) }),
      el("td", {}, el("div", { class: "budget" }, el("span", { class: "track" }, fillBar), el("span", { class: "amount", text: share.toFixed(1) + "%" }))),
    );
  });
  $("top").tBodies[0].replaceChildren(...(rows.length ? rows : [emptyRow("top", "No usage in this period.")]));
}

/** The y axis for values up to ``max``: a step of 1, 2, 2.5 or 5 × a power of ten, about 4 of them. */
function axis(max) {
  if (max <= 0) return { top: 1, step: 0.25 };
  const raw = max / 4;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
  return { top: Math.ceil(max / step - 1e-9) * step, step };
}

/** Stacked bars, one per day, on a 1000×220 canvas (the SVG's viewBox). */
function drawChart(svg, days, series, key, format, axisFormat, label) {
  const W = 1000;
  const H = 220;
  const left = 64;
  const bottom = 22;
  const top = 10;
  const plotW = W - left - 8;
  const plotH = H - top - bottom;
  const sums = new Float64Array(days.length);
  for (const s of series) for (let i = 0; i < days.length; i++) sums[i] += s[key][i];
  const { top: max, step } = axis(Math.max(0, ...sums));
  const y = (v) => top + plotH - (v / max) * plotH;
  const parts = [];
  for (let k = 0; k <= Math.round(max / step); k++) {
    const v = k * step;
    parts.push(svgEl("line", { class: "grid", x1: left, x2: W - 8, y1: y(v), y2: y(v) }));
    parts.push(svgEl("text", { class: "axis", x: left - 6, y: y(v) + 4, "text-anchor": "end", text: axisFormat(v) }));
  }
  const band = plotW / days.length;
  const width = Math.max(1, band * 0.8);
  const every = Math.ceil(days.length / 10);
  for (let i = 0; i < days.length; i++) {
    const x = left + i * band + (band - width) / 2;
    if (i % every === 0) parts.push(svgEl("text", { class: "axis", x: x + width / 2, y: H - 6, "text-anchor": "middle", text: days[i].slice(5) }));
    let base = 0;
    for (const s of series) {
      const v = s[key][i];
      if (v <= 0) continue;
      parts.push(
        svgEl(
          "rect",
          { class: "bar", x: x.toFixed(2), y: y(base + v).toFixed(2), width: width.toFixed(2), height: Math.max(0.5, y(base) - y(base + v)).toFixed(2), fill: s.color },
          svgEl("title", { text: `${days[i]} · ${s.name}: ${format(v)}` }),
        ),
      );
      base += v;
    }
  }
  if (!sums.some((v) => v > 0)) parts.push(svgEl("text", { class: "axis", x: left + plotW / 2, y: top + plotH / 2, "text-anchor": "middle", text: "No usage in this period" }));
  svg.setAttribute("aria-label", label);
  svg.replaceChildren(...parts);
}

async function downloadCsv() {
  const button = $("csv");
  button.disabled = true;
  try {
    const response = await api(`manage/usage?${usageQuery()}&format=csv`, { accept: "text/csv" });
    const blob = await response.blob();
    const named = /filename="([^"]+)"/.exec(response.headers.get("content-disposition") || "");
    const link = el("a", { href: URL.createObjectURL(blob), download: named ? named[1] : "usage.csv" });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ start

function start() {
  const names = Object.keys(VIEWS);
  for (const name of names) $("tab-" + name).addEventListener("click", () => select(name));
  document.querySelector('[role="tablist"]').addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const next = names[(names.indexOf(current) + step + names.length) % names.length];
    select(next);
    $("tab-" + next).focus();
  });
  $("retry").addEventListener("click", () => retryView && retryView());
  $("key-box").addEventListener("submit", (event) => {
    event.preventDefault();
    storeKey($("key").value.trim());
    $("key").value = "";
    refresh();
  });
  $("forget-key").addEventListener("click", () => {
    storeKey("");
    $("key").value = "";
  });
  $("new-team").addEventListener("click", () => openEditor("team", null));
  $("new-caller").addEventListener("click", () => openEditor("caller", null));
  $("editor-form").addEventListener("submit", saveEditor);
  $("confirm-form").addEventListener("submit", runConfirmed);
  $("new-key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    $("new-key").close();
  });
  $("new-key").addEventListener("close", forgetNewKey);
  $("copy-key").addEventListener("click", copyKey);
  for (const dialog of document.querySelectorAll("dialog")) {
    for (const cancel of dialog.querySelectorAll(".cancel")) cancel.addEventListener("click", () => dialog.close());
  }
  $("period").addEventListener("change", () => {
    if ($("period").value === "custom") return;
    [$("from").value, $("to").value] = presetPeriod($("period").value);
    refresh();
  });
  for (const id of ["from", "to"]) $(id).addEventListener("input", () => ($("period").value = "custom"));
  $("usage-form").addEventListener("submit", (event) => {
    event.preventDefault();
    refresh();
  });
  for (const radio of document.querySelectorAll('input[name="by"]')) radio.addEventListener("change", () => lastUsage && renderUsage());
  $("csv").addEventListener("click", downloadCsv);
  if (storedKey()) showKeyBox(); // so that it can be forgotten
  select(location.hash.slice(1));
}

window.addEventListener("unhandledrejection", (event) => showError(event.reason));
start();
