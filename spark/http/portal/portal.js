// Spark's portal: reads the server's own APIs and draws them; no library, no build step.
//
//   /api/inference/status  the profile card and the switch's progress (polled; faster while switching)
//   /api/inference/logs    the log tail and the recent activity
//   /api/inference/activity  requests and tokens per client, last hour and day
//   /api/inference/usage   the usage chart and table
//   /v1/models, /v1/chat/completions (streamed)  the chat playground
//
// The keys typed into the page stay in this tab (sessionStorage) and go out as
// `Authorization: Bearer ...`: the API key for /v1 and reads, the admin key for switching
// (it is accepted for reads too).
"use strict";

const POLL_MS = 2000;
const SWITCH_POLL_MS = 400;
const USAGE_POLL_MS = 5000;
const CLIENTS_POLL_MS = 10000;
const LOG_LINES = 200;
const ACTIVITY_ROWS = 20;
const WINDOWS = [["hour", "1h"], ["day", "24h"], ["total", "total"]];

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";

/** An element with attributes (`class`, `data-*`, properties for the rest) and children (strings or nodes). */
function h(tag, attrs = {}, ...children) {
  const el = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "class" || k.startsWith("data-") || el instanceof SVGElement) el.setAttribute(k, v);
    else el[k] = v;
  }
  for (const c of children) if (c !== null && c !== undefined) el.append(c);
  return el;
}

const fmtInt = (n) => Number(n || 0).toLocaleString("en-US");
const fmtTime = (ts) => new Date(ts * 1000).toLocaleTimeString([], {hour12: false});
function fmtAgo(ts) {
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

// -- keys and requests ---------------------------------------------------------------------------

const keys = {
  api: () => $("api-key").value.trim(),
  admin: () => $("admin-key").value.trim(),
  read: () => keys.admin() || keys.api(),
};

function keepKeys() {
  let typing = null;
  for (const id of ["api-key", "admin-key"]) {
    const input = $(id);
    input.value = sessionStorage.getItem(`spark.${id}`) || "";
    input.addEventListener("input", () => {
      sessionStorage.setItem(`spark.${id}`, input.value.trim());
      clearTimeout(typing);
      typing = setTimeout(refreshAll, 300);  // once the key is typed, not at each character
    });
  }
}

class ApiFailure extends Error {
  constructor(status, message, code, retryAfter) {
    super(message);
    Object.assign(this, {status, code, retryAfter});
  }
}

/** Read a failed response's error object (OpenAI's shape) into an ApiFailure. */
async function failure(r) {
  let message = `${r.status} ${r.statusText}`, code = null;
  try {
    const body = await r.json();
    if (body && body.error) ({message, code} = {message: body.error.message || message, code: body.error.code});
  } catch (_) { /* not JSON */ }
  return new ApiFailure(r.status, message, code, r.headers.get("Retry-After"));
}

/** fetch with the key; JSON back, or an ApiFailure thrown. */
async function api(path, {method = "GET", body, key = keys.read(), signal} = {}) {
  const headers = {};
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal});
  if (!r.ok) throw await failure(r);
  return r.json();
}

function notice(text) {
  const el = $("notice");
  el.textContent = text || "";
  el.hidden = !text;
}

// -- profile and switching -----------------------------------------------------------------------

let lastStatus = null;
let switching = null;  // {id, started} while a switch asked from this page runs

async function refreshHealth() {
  const badge = $("health");
  try {
    const r = await fetch("/health");
    const ok = r.ok;
    badge.textContent = ok ? "healthy" : (r.status === 503 ? "not ready" : `health ${r.status}`);
    badge.className = `badge ${ok ? "ok" : "bad"}`;
  } catch (_) {
    badge.textContent = "unreachable";
    badge.className = "badge bad";
  }
}

async function refreshStatus() {
  let status;
  try {
    status = await api("/api/inference/status");
  } catch (e) {
    if (e.status === 401 || e.status === 403) notice("This server has keys: type the API key or the admin key above.");
    else notice(`status: ${e.message}`);
    return;
  }
  notice("");
  const changed = !lastStatus || lastStatus.state !== status.state ||
    (lastStatus.active || {}).id !== (status.active || {}).id;
  lastStatus = status;
  drawProfile(status);
  drawSwitchProgress(status);
  if (changed) {
    refreshModels();
    refreshHealth();
  }
}

function drawProfile(status) {
  const active = status.active;
  $("active-profile").textContent = active ? active.id : "none";
  $("active-served").textContent = active ? `${active.served_name} (${active.engine})` : "–";
  const state = $("slot-state");
  state.textContent = status.state + (status.target ? ` → ${status.target}` : "");
  state.className = `badge ${status.state}`;
  $("slot-since").textContent = `since ${fmtAgo(status.since)}` + (status.error ? ` · ${status.error}` : "");
  $("active-streams").textContent = active && active.open_streams !== undefined
    ? `${active.open_streams} open · ${fmtInt(active.kv_pages_in_use)} KV pages in use` : "–";
  $("active-context").textContent = active && active.max_model_len ? `${fmtInt(active.max_model_len)} tokens` : "–";

  const select = $("switch-recipe");
  const chosen = select.value;
  const options = status.recipes.filter((r) => r.state !== "unavailable").map((r) =>
    h("option", {value: r.id, textContent: `${r.id}${r.draft ? " (draft)" : ""}${r.state === "active" ? " · active" : ""}`}));
  if (select.options.length !== options.length || [...select.options].some((o, i) => o.textContent !== options[i].textContent)) {
    select.replaceChildren(...options);
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
  }
  const body = $("recipes").tBodies[0];
  body.replaceChildren(...status.recipes.map((r) => h("tr", {"data-recipe": r.id},
    h("td", {}, r.id), h("td", {}, r.served_name), h("td", {}, r.engine),
    h("td", {title: r.reason || ""}, h("span", {class: `badge ${r.state}`}, r.state)))));
  $("recipe-problems").replaceChildren(...(status.problems || []).map((p) => h("li", {}, p)));
}

function drawSwitchProgress(status) {
  const box = $("switch-progress"), bar = $("switch-bar"), text = $("switch-text");
  const busy = status.state === "draining" || status.state === "loading";
  if (!switching && !busy) {
    box.hidden = true;
    return;
  }
  box.hidden = false;
  const target = (switching && switching.id) || status.target;
  const started = switching ? switching.started : status.since * 1000;
  const elapsed = Math.max(0, (Date.now() - started) / 1000);
  if (busy) {
    const eta = status.eta_s || 1;
    bar.value = Math.min(0.95, elapsed / (elapsed + eta));
    const what = status.state === "draining" ? "letting open streams finish" : `loading ${status.target || "…"}`;
    text.textContent = `${what} · ${elapsed.toFixed(1)} s, about ${Math.round(eta)} s left`;
    box.dataset.state = "switching";
    return;
  }
  if (switching) {  // the switch this page asked for is over
    const done = status.state === "active" && status.active && status.active.id === target;
    bar.value = done ? 1 : 0;
    text.textContent = done ? `${target} is ready (${elapsed.toFixed(1)} s)` : `switch to ${target} failed: ${status.error || status.state}`;
    box.dataset.state = done ? "ready" : "failed";
    switching = null;
  }
}

async function switchTo(id) {
  $("profile-error").textContent = "";
  switching = {id, started: Date.now()};
  $("switch-progress").hidden = false;
  $("switch-progress").dataset.state = "switching";
  $("switch-bar").removeAttribute("value");  // indeterminate until the first status
  $("switch-text").textContent = `asking to switch to ${id}…`;
  try {
    await api("/api/inference/up", {method: "POST", body: {id}, key: keys.admin()});
  } catch (e) {
    switching = null;
    $("switch-progress").hidden = true;
    $("profile-error").textContent = e.status === 401 || (e.status === 403 && !keys.admin())
      ? `Switching needs the admin key: ${e.message}` : e.message;
    return;
  }
  while (switching) {
    await refreshStatus();
    if (switching) await sleep(SWITCH_POLL_MS);
  }
  refreshUsage();
  refreshLogs();
}

async function takeDown() {
  $("profile-error").textContent = "";
  try {
    await api("/api/inference/down", {method: "POST", body: {}, key: keys.admin()});
  } catch (e) {
    $("profile-error").textContent = e.message;
  }
  refreshStatus();
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// -- usage ---------------------------------------------------------------------------------------

async function refreshUsage() {
  let usage, roi;
  try {
    ({recipes: usage, roi} = await api("/api/inference/usage"));
  } catch (_) {
    return;  // the status line says why
  }
  drawRoi(roi);
  const ids = new Set(Object.keys(usage));
  for (const r of (lastStatus ? lastStatus.recipes : [])) if (r.state === "active") ids.add(r.id);
  const rows = [...ids].sort().map((id) => ({id, windows: usage[id] || {}}));
  drawUsageChart(rows);
  drawUsageTable(rows);
}

/** Horizontal bars, three per recipe (1h, 24h, total), prompt and completion tokens stacked, one scale. */
function drawUsageChart(rows) {
  const svg = $("usage-chart");
  const width = Math.max(320, svg.clientWidth || 480), labelW = 56, valueW = 150, barH = 14, gap = 4, head = 20;
  const groupH = head + WINDOWS.length * (barH + gap) + 8;
  const tokens = (w) => (w ? w.prompt_tokens + w.completion_tokens : 0);
  const max = Math.max(1, ...rows.map((r) => tokens(r.windows.total)));
  const span = width - labelW - valueW;
  const parts = [];
  rows.forEach((row, i) => {
    const y0 = i * groupH;
    parts.push(h("svg:text", {class: "recipe", x: 0, y: y0 + 14}, row.id));
    WINDOWS.forEach(([key, label], j) => {
      const w = row.windows[key] || {requests: 0, prompt_tokens: 0, completion_tokens: 0};
      const y = y0 + head + j * (barH + gap);
      const pw = (w.prompt_tokens / max) * span, cw = (w.completion_tokens / max) * span;
      const title = `${row.id} · ${label}: ${fmtInt(w.requests)} requests, ${fmtInt(w.prompt_tokens)} prompt + ` +
        `${fmtInt(w.completion_tokens)} completion tokens`;
      parts.push(h("svg:g", {class: "bar", "data-recipe": row.id, "data-window": key, "data-requests": w.requests,
                             "data-prompt-tokens": w.prompt_tokens, "data-completion-tokens": w.completion_tokens},
        h("svg:title", {}, title),
        h("svg:text", {class: "window", x: 8, y: y + barH - 3}, label),
        h("svg:rect", {class: "prompt", x: labelW, y, width: pw.toFixed(1), height: barH, rx: 2}),
        h("svg:rect", {class: "completion", x: (labelW + pw).toFixed(1), y, width: cw.toFixed(1), height: barH, rx: 2}),
        h("svg:text", {class: "value", x: labelW + pw + cw + 6, y: y + barH - 3},
          `${fmtInt(tokens(w))} tok · ${fmtInt(w.requests)} req`)));
    });
  });
  if (!rows.length) parts.push(h("svg:text", {class: "empty", x: 0, y: 16}, "no usage yet"));
  const height = Math.max(24, rows.length * groupH);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("height", height);
  svg.replaceChildren(...parts);
}

function drawUsageTable(rows) {
  const body = $("usage-table").tBodies[0];
  body.replaceChildren(...rows.flatMap((row) => WINDOWS.map(([key, label]) => {
    const w = row.windows[key] || {requests: 0, prompt_tokens: 0, completion_tokens: 0};
    return h("tr", {"data-recipe": row.id, "data-window": key}, h("td", {}, row.id), h("td", {}, label),
      h("td", {}, fmtInt(w.requests)), h("td", {}, fmtInt(w.prompt_tokens)), h("td", {}, fmtInt(w.completion_tokens)));
  })));
}

function fmtUsd(v) {
  if (v === null || v === undefined) return "no price";
  return `$${v === 0 ? "0" : v >= 1 ? v.toFixed(2) : v >= 0.01 ? v.toFixed(4) : v.toPrecision(2)}`;
}

/** What each ROI profile's recipes' tokens would have cost on its cloud model (hidden when none is tagged). */
function drawRoi(roi) {
  const profiles = Object.entries((roi && roi.profiles) || {}).sort(([a], [b]) => a.localeCompare(b));
  $("roi-table").hidden = !profiles.length;
  $("roi-table").tBodies[0].replaceChildren(...profiles.map(([id, p]) => h("tr", {"data-profile": id},
    h("td", {title: `recipes: ${p.recipes.join(", ")}`}, id), h("td", {}, `${p.provider} ${p.model}`),
    ...WINDOWS.map(([key]) => h("td", {"data-window": key, "data-usd": p[key] === null ? "" : p[key]}, fmtUsd(p[key]))))));
}

// -- logs and activity ---------------------------------------------------------------------------

let lastLogKey = "";

async function refreshLogs() {
  let logs;
  try {
    logs = await api(`/api/inference/logs?n=${LOG_LINES}`);
  } catch (_) {
    return;
  }
  const lines = [
    ...logs.events.map((e) => ({ts: e.time, cls: e.event === "failed" ? "failed" : "event",
      text: `${e.event.padEnd(9)} ${e.recipe || "-"}: ${e.detail}`})),
    ...logs.activity.map((a) => ({ts: a.ts, cls: a.outcome === "ok" ? "" : "failed",
      text: `${String(a.status).padEnd(9)} ${a.recipe || a.model || "-"} ${a.endpoint} ${a.prompt_tokens}+` +
            `${a.completion_tokens} tokens in ${Number(a.latency_s).toFixed(2)} s${a.stream ? " (stream)" : ""}` +
            `${a.outcome !== "ok" ? ` ${a.outcome}` : ""}${a.error ? `: ${a.error}` : ""}`})),
  ].sort((a, b) => a.ts - b.ts).slice(-LOG_LINES);
  const key = lines.length ? `${lines.length}:${lines[lines.length - 1].ts}:${lines[lines.length - 1].text}` : "";
  if (key !== lastLogKey) {
    lastLogKey = key;
    const pre = $("log-tail");
    pre.replaceChildren(...lines.map((l) => h("div", {class: l.cls}, `${fmtTime(l.ts)}  ${l.text}`)));
    if ($("log-follow").checked) pre.scrollTop = pre.scrollHeight;
  }
  drawActivity(logs.activity.slice(-ACTIVITY_ROWS).reverse());
}

function drawActivity(records) {
  const body = $("activity-table").tBodies[0];
  if (!records.length) {
    body.replaceChildren(h("tr", {}, h("td", {colSpan: 9, class: "muted"}, "no requests yet")));
    return;
  }
  body.replaceChildren(...records.map((a) => h("tr", {class: a.outcome === "ok" ? "" : "failed"},
    h("td", {title: a.time}, fmtTime(a.ts)), h("td", {}, a.recipe || "–"), h("td", {}, a.model || "–"),
    h("td", {}, a.endpoint), h("td", {class: "num"}, fmtInt(a.prompt_tokens)),
    h("td", {class: "num"}, fmtInt(a.completion_tokens)), h("td", {class: "num"}, `${Number(a.latency_s).toFixed(2)} s`),
    h("td", {title: a.error || ""}, `${a.status} ${a.outcome}`), h("td", {}, a.key_id || "–"))));
}

/** Requests, errors and tokens per client over the last hour and day (``/api/inference/activity``). */
async function refreshClients() {
  let rollup;
  try {
    rollup = await api("/api/inference/activity");
  } catch (_) {
    return;
  }
  const body = $("clients-table").tBodies[0];
  if (!rollup.day) {
    body.replaceChildren(h("tr", {}, h("td", {colSpan: 6, class: "muted"}, rollup.note || "no activity log")));
    return;
  }
  const tokens = (row) => (row ? row.prompt_tokens + row.completion_tokens : 0);
  const rows = [["all", rollup.hour, rollup.day],
    ...Object.keys(rollup.day.clients).sort().map((id) => [id, rollup.hour.clients[id], rollup.day.clients[id]])];
  body.replaceChildren(...rows.map(([id, hour, day]) => h("tr", {"data-client": id},
    h("td", {}, id), h("td", {class: "num"}, fmtInt(hour ? hour.requests : 0)), h("td", {class: "num"}, fmtInt(day.requests)),
    h("td", {class: "num"}, fmtInt(day.errors)), h("td", {class: "num"}, fmtInt(tokens(hour))),
    h("td", {class: "num"}, fmtInt(tokens(day))))));
}

// -- chat ----------------------------------------------------------------------------------------

const history = [];  // the conversation sent with each request
let abort = null;

async function refreshModels() {
  let models;
  try {
    models = (await api("/v1/models", {key: keys.api() || keys.admin()})).data;
  } catch (_) {
    return;
  }
  const select = $("chat-model"), chosen = select.value;
  const names = models.filter((m) => m.id !== "sparky" && m.state !== "unavailable");
  select.replaceChildren(h("option", {value: "sparky"}, "sparky (the active model)"),
    ...names.map((m) => h("option", {value: m.id}, `${m.id}${m.state === "active" ? " · active" : ""}`)));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

function messageView(role) {
  const view = {
    root: h("div", {class: `msg ${role}`, "data-role": role}),
    reasoning: null, reasoningText: null, content: h("div", {class: "content"}), calls: h("div", {class: "tool-calls"}),
    meta: h("div", {class: "meta"}),
  };
  view.root.append(h("div", {class: "who"}, role), view.content, view.calls, view.meta);
  $("chat-log").append(view.root);
  return view;
}

function showReasoning(view, text) {
  if (!view.reasoning) {
    view.reasoningText = h("div", {class: "text"});
    view.reasoning = h("details", {class: "reasoning", open: true}, h("summary", {}, "Thinking"), view.reasoningText);
    view.root.insertBefore(view.reasoning, view.content);
  }
  view.reasoningText.textContent = text;
}

function showToolCalls(view, calls) {
  view.calls.replaceChildren(...calls.filter(Boolean).map((c) => {
    let args = c.function.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* still streaming, or not JSON */ }
    return h("div", {class: "tool-call", "data-name": c.function.name},
      h("span", {class: "name"}, `${c.function.name || "…"}()`), h("span", {class: "muted"}, c.id ? `  ${c.id}` : ""),
      h("pre", {}, args));
  }));
}

function chatBody() {
  const messages = [];
  const system = $("chat-system").value.trim();
  if (system) messages.push({role: "system", content: system});
  const body = {
    model: $("chat-model").value || "sparky", messages: messages.concat(history), stream: true,
    stream_options: {include_usage: true},
    max_tokens: Number($("chat-max-tokens").value) || undefined,
    temperature: $("chat-temperature").value === "" ? undefined : Number($("chat-temperature").value),
  };
  const tools = $("chat-tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);  // a SyntaxError is shown by send()
  return body;
}

/** Yield each `data:` payload of a server-sent event stream. */
async function* sseData(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true}).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

/** The results typed into the last reply's tool calls, as `tool` messages (the inputs are then done with). */
function takeToolResults() {
  const inputs = [...$("chat-log").querySelectorAll("input.tool-result:not([disabled])")];
  const results = inputs.filter((i) => i.value.trim()).map((i) => ({role: "tool", tool_call_id: i.dataset.callId,
                                                                   content: i.value.trim()}));
  if (results.length) for (const i of inputs) i.disabled = true;
  return results;
}

async function send(text, results) {
  const turn = [...results, ...(text ? [{role: "user", content: text}] : [])];
  let body;
  try {
    history.push(...turn);
    body = chatBody();
  } catch (e) {
    history.splice(history.length - turn.length);
    $("chat-status").textContent = `tools: ${e.message}`;
    return;
  }
  for (const m of turn) {
    const view = messageView(m.role);
    view.content.textContent = m.role === "tool" ? `${m.tool_call_id}: ${m.content}` : m.content;
  }
  const view = messageView("assistant");
  view.root.dataset.state = "waiting";
  view.root.dataset.chunks = "0";
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  $("chat-status").textContent = "waiting for the first token…";
  abort = new AbortController();
  const t0 = performance.now();
  let tFirst = null, content = "", reasoning = "", usage = null, finish = null, chunks = 0;
  const calls = [];
  try {
    const key = keys.api() || keys.admin();
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: abort.signal, body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", ...(key ? {Authorization: `Bearer ${key}`} : {})},
    });
    if (!r.ok) throw await failure(r);
    view.root.dataset.state = "streaming";
    view.meta.textContent = r.headers.get("X-Spark-Served-Model") ? `${r.headers.get("X-Spark-Served-Model")}` : "";
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiFailure(500, chunk.error.message, chunk.error.code);
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const said = delta.reasoning_content || delta.reasoning || "";
      if (said || delta.content || delta.tool_calls) {
        tFirst = tFirst || performance.now();
        view.root.dataset.chunks = String(++chunks);
      }
      if (said) showReasoning(view, (reasoning += said));
      if (delta.content) view.content.textContent = (content += delta.content);
      for (const call of delta.tool_calls || []) {
        const c = calls[call.index] || (calls[call.index] = {id: "", type: "function", function: {name: "", arguments: ""}});
        if (call.id) c.id = call.id;
        if (call.function && call.function.name) c.function.name += call.function.name;
        if (call.function && call.function.arguments) c.function.arguments += call.function.arguments;
        showToolCalls(view, calls);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      $("chat-status").textContent = "streaming…";
    }
    const message = {role: "assistant", content: content || null};
    if (calls.length) message.tool_calls = calls.filter(Boolean);
    history.push(message);
    for (const [i, card] of [...view.calls.children].entries()) {  // what each call returned, to send back
      card.append(h("input", {class: "tool-result", placeholder: "its result, sent back with the next message",
                              "data-call-id": message.tool_calls[i].id}));
    }
    if (view.reasoning) view.reasoning.open = false;
    view.root.dataset.state = "done";
    const seconds = (performance.now() - t0) / 1000;
    const bits = [view.meta.textContent, finish && `finish: ${finish}`,
      tFirst && `first token ${((tFirst - t0) / 1000).toFixed(2)} s`,
      usage && `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`,
      usage && tFirst && seconds > 0 && `${(usage.completion_tokens / Math.max(1e-3, (performance.now() - tFirst) / 1000)).toFixed(1)} tok/s`];
    view.meta.textContent = bits.filter(Boolean).join(" · ");
    $("chat-status").textContent = "";
  } catch (e) {
    history.splice(history.length - turn.length);  // the turn goes again with the next message
    view.root.classList.add("error");
    view.root.dataset.state = e.name === "AbortError" ? "stopped" : "error";
    const why = e.name === "AbortError" ? "stopped" : e.message + (e.retryAfter ? ` (retry in ${e.retryAfter} s)` : "");
    view.meta.append(h("div", {class: "failure"}, why));
    $("chat-status").textContent = "";
  } finally {
    abort = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    setTimeout(() => { refreshUsage(); refreshLogs(); refreshClients(); }, 300);  // counted once its body ended
  }
}

function wireChat() {
  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (abort) return;
    const text = $("chat-input").value.trim(), results = takeToolResults();
    if (!text && !results.length) return;
    $("chat-input").value = "";
    send(text, results);
  });
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => abort && abort.abort());
  $("chat-clear").addEventListener("click", () => {
    history.length = 0;
    $("chat-log").replaceChildren();
  });
}

// -- start ---------------------------------------------------------------------------------------

function refreshAll() {
  refreshHealth();
  refreshStatus().then(() => { refreshUsage(); refreshModels(); });
  refreshLogs();
  refreshClients();
}

function every(ms, fn) {
  setInterval(() => { if (!document.hidden && !switching) fn(); }, ms);
}

document.addEventListener("DOMContentLoaded", () => {
  keepKeys();
  wireChat();
  $("switch-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (!switching && $("switch-recipe").value) switchTo($("switch-recipe").value);
  });
  $("down-button").addEventListener("click", takeDown);
  refreshAll();
  every(POLL_MS, () => { refreshStatus(); refreshLogs(); refreshHealth(); });
  every(USAGE_POLL_MS, refreshUsage);
  every(CLIENTS_POLL_MS, refreshClients);  // the server reads its whole activity log for it
  window.addEventListener("resize", () => refreshUsage());
});
