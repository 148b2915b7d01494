// The chat page of pp-serve: conversations streamed from /v1/chat/completions (SSE read from fetch, since
// EventSource cannot POST) and kept in this browser's localStorage; answers rendered as markdown (marked), sanitized
// (DOMPurify) since a model's output is untrusted HTML. It reads the model and its context from /props, and asks for
// the API key when the server answers 401, keeping it for this tab (sessionStorage) so it is asked for once.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pp-serve-api-key";
const CONVERSATIONS_STORE = "pp-serve-conversations";
const CURRENT_STORE = "pp-serve-current";
const SETTINGS_STORE = "pp-serve-settings";
// The settings sent with each request: [input id, request field, /props default_generation_settings.params name]
const SAMPLING = [
  ["temperature", "temperature", "temperature"], ["top-k", "top_k", "top_k"], ["top-p", "top_p", "top_p"],
  ["min-p", "min_p", "min_p"], ["repeat-penalty", "repetition_penalty", null],
  ["presence-penalty", "presence_penalty", "presence_penalty"],
  ["frequency-penalty", "frequency_penalty", "frequency_penalty"],
  ["max-tokens", "max_tokens", "n_predict"], ["seed", "seed", "seed"],
];
const SETTING_IDS = ["system", ...SAMPLING.map(([id]) => id)];

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  props: null,
  conversations: conversationsKept(),  // {id, title, updated, messages}, the last used first
  current: localStorage.getItem(CURRENT_STORE),  // the id of the one shown; null: a new one, not saved yet
  controller: null,  // the answer in progress (AbortController), null when idle
};

function readJson(storage, name, fallback) {
  try {
    return JSON.parse(storage.getItem(name)) ?? fallback;
  } catch {
    return fallback;  // not ours, or damaged: start over rather than fail to load
  }
}

function conversationsKept() {
  const kept = readJson(localStorage, CONVERSATIONS_STORE, []);
  return Array.isArray(kept) ? kept.filter((c) => c && Array.isArray(c.messages)) : [];
}

function save() {
  try {
    localStorage.setItem(CONVERSATIONS_STORE, JSON.stringify(state.conversations));
    if (state.current) localStorage.setItem(CURRENT_STORE, state.current);
    else localStorage.removeItem(CURRENT_STORE);
  } catch (e) {  // the browser's quota: the page still works, the conversations are not kept
    banner(`Cannot keep the conversations in this browser (${e.message}); delete some old ones.`);
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return response.statusText;
  }
}

function banner(text) {
  $("banner").textContent = text || "";
  $("banner").hidden = !text;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// --- the server ---------------------------------------------------------------------------------------------------
async function load() {
  let response;
  try {
    response = await fetch("/props", { headers: headers() });
  } catch (e) {
    banner(`Cannot reach the server (${e.message}); retrying…`);
    setTimeout(load, 3000);
    return;
  }
  if (response.status === 401) {
    askKey(state.key ? "That key was refused; try another." : "This server needs an API key.");
    return;
  }
  if (response.status === 503) {  // the stages restarting: it will answer soon
    banner(`The server is not ready: ${await errorText(response)}; retrying…`);
    setTimeout(load, 3000);
    return;
  }
  if (!response.ok) {
    banner(`The server answered ${response.status}: ${await errorText(response)}`);
    return;
  }
  showProps(await response.json());
}

function showProps(props) {
  state.props = props;
  banner("");
  $("model").textContent = props.model || "(unnamed model)";
  $("ctx").textContent = props.n_ctx ? `ctx ${props.n_ctx}` : "";
  $("ctx").hidden = !props.n_ctx;
  const params = (props.default_generation_settings || {}).params || {};
  for (const [id, , param] of SAMPLING) {
    const value = param ? params[param] : null;
    $(id).placeholder = `default (${value ?? (id === "temperature" ? "0: greedy" : "unset")})`;
  }
  setBusy(false);
  $("prompt").focus();
}

function askKey(message) {
  $("key-message").textContent = message;
  $("key-dialog").hidden = false;
  $("key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key").value = "";
  $("key-dialog").hidden = true;
  load();
});

// --- markdown -----------------------------------------------------------------------------------------------------
const MARKDOWN = window.marked && window.DOMPurify;
if (MARKDOWN) {
  // a link in an answer opens elsewhere and tells that site nothing of this page
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

// An answer's text as HTML: markdown rendered (a line break kept as one: models write verse and lists so), then
// sanitized (no script, no event handler, no javascript: URL, no style that could cover the page's own controls);
// as plain text if the libraries did not load.
function showAnswer(box, text) {
  if (!MARKDOWN) {
    box.textContent = text;
    return;
  }
  box.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: true }).trim(),
    { FORBID_TAGS: ["style", "form"], FORBID_ATTR: ["style"] });
  for (const pre of box.querySelectorAll("pre")) {
    const code = pre.textContent;
    const button = element("button", "copy-code", "Copy");
    button.type = "button";
    button.addEventListener("click", () => copy(code, button));
    pre.prepend(button);
  }
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);  // only in a secure context (https, or localhost)
  } catch {
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1200);
}

// --- the conversations --------------------------------------------------------------------------------------------
function current() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);  // randomUUID needs a secure context
}

function showList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = element("li", conversation.id === state.current ? "active" : "");
    const open = element("button", "open", conversation.title);
    open.type = "button";
    open.title = conversation.title;
    open.addEventListener("click", () => switchTo(conversation.id));
    const remove = element("button", "delete", "×");
    remove.type = "button";
    remove.title = `Delete “${conversation.title}”`;
    remove.setAttribute("aria-label", remove.title);
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    list.append(item);
  }
}

function switchTo(id) {
  stop();
  state.current = id;
  save();
  show();
}

function deleteConversation(id) {
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (id !== state.current) {
    save();
    showList();  // the conversation shown stays as it is (an answer may be streaming into it)
    return;
  }
  switchTo(null);
}

// The current conversation, drawn again from its messages; and the list beside it.
function show() {
  showList();
  for (const box of $("conversation").querySelectorAll(".message")) box.remove();
  const conversation = current();
  const messages = conversation ? conversation.messages : [];
  $("empty").hidden = messages.length > 0;
  messages.forEach((message, i) => $("conversation").append(messageView(conversation, i)));
  setBusy(Boolean(state.controller));
  scrollDown();
}

function messageView(conversation, i) {
  const message = conversation.messages[i];
  const box = element("article", `message ${message.role}`);
  const text = element("div", "text");
  if (message.role === "assistant") showAnswer(text, message.content);
  else text.textContent = message.content;  // what the user typed, as typed
  box.append(text);
  if (message.stats) box.append(element("div", "stats", statsText(message.stats)));
  if (message.error) box.append(element("div", "error", message.error));
  const tools = element("div", "tools");
  tools.append(tool("Copy", "copy", (button) => copy(message.content, button)),
    tool("Edit", "edit changes", () => edit(conversation, i, box)));
  if (message.role === "assistant") {
    tools.append(tool("Regenerate", "regenerate changes", () => regenerate(conversation, i)));
  }
  box.append(tools);
  return box;
}

function tool(label, className, action) {
  const button = element("button", className, label);
  button.type = "button";
  button.addEventListener("click", () => action(button));
  return button;
}

// A message's text in an editor, in place: a user's message saved is sent again (what came after it goes), an
// answer saved is kept as written (the next turns send it so).
function edit(conversation, i, box) {
  const message = conversation.messages[i];
  const area = element("textarea", "editor");
  area.value = message.content;
  area.rows = Math.min(12, message.content.split("\n").length + 1);
  const saveButton = tool(message.role === "user" ? "Save and send" : "Save", "primary", () => {
    const text = area.value.trim();
    if (!text || state.controller) return;
    message.content = text;
    if (message.role === "user") {
      conversation.messages.splice(i + 1);
      answer(conversation);
    } else {
      delete message.stats;  // they were the model's answer's, not this text's
      delete message.error;  // an answer written by hand did not fail: later turns send it
      touch(conversation);
      show();
    }
  });
  const editing = element("div", "editing");
  editing.append(area, element("div", "tools"));
  editing.lastChild.append(saveButton, tool("Cancel", "", show));
  box.replaceChildren(editing);
  area.focus();
}

function regenerate(conversation, i) {
  if (state.controller) return;
  conversation.messages.splice(i);
  answer(conversation);
}

function touch(conversation) {
  if (!state.conversations.includes(conversation)) return;  // deleted while its answer was coming
  conversation.updated = Date.now();
  state.conversations = [conversation, ...state.conversations.filter((c) => c !== conversation)];
  save();
}

function scrollDown() {
  const view = $("conversation");
  view.scrollTop = view.scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("send").disabled = busy || !state.props;
  $("prompt").disabled = !state.props;
  for (const button of document.querySelectorAll(".tools .changes")) button.disabled = busy;
}

// --- answering ----------------------------------------------------------------------------------------------------
// The SSE events of a streamed answer, parsed: pp-serve's chunks, then [DONE] (or the end of the body).
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// The request for the conversation's next answer: its turns (an answer that failed left out), after the system
// prompt, with the settings that are set; the rest take the server's defaults.
function request(conversation) {
  const system = $("system").value.trim();
  const turns = conversation.messages.filter((m) => !m.error).map(({ role, content }) => ({ role, content }));
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...turns];
  const body = { model: state.props.model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [id, field] of SAMPLING) {
    if ($(id).value !== "") body[field] = Number($(id).value);
  }
  return body;
}

function send(text) {
  let conversation = current();
  if (!conversation) {
    const title = text.split("\n")[0].slice(0, 60);
    conversation = { id: newId(), title, updated: Date.now(), messages: [] };
    state.conversations.unshift(conversation);
    state.current = conversation.id;
  }
  conversation.messages.push({ role: "user", content: text });
  answer(conversation);
}

// The conversation's next answer: streamed into its bubble; under it the tokens, tokens/s and time to first token,
// measured here (what the reader waited), the decode rate over the tokens after the first, and the prompt tokens the
// server reused from its cache (prefix reuse) where it says.
async function answer(conversation) {
  const body = request(conversation);
  const message = { role: "assistant", content: "" };
  conversation.messages.push(message);
  touch(conversation);
  state.controller = new AbortController();
  show();
  const shown = $("conversation").lastElementChild.querySelector(".text");
  shown.parentElement.classList.add("streaming");
  const t0 = performance.now();
  let first = 0, pieces = 0, raw = "", usage = null, finish = "";
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: state.controller.signal });
    if (response.status === 401) askKey("The server refused the key; enter it again, then regenerate.");
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of events(response.body)) {
      if (event.error) throw new Error(event.error.message);
      usage = event.usage || usage;
      const choice = (event.choices || [])[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        first = first || performance.now();
        pieces += 1;
        raw += piece;
        message.content = raw.trimStart();  // a model's answer often starts with the space of its first word
        showAnswer(shown, message.content);
        scrollDown();
      }
      finish = (choice && choice.finish_reason) || finish;
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else message.error = e.message;  // kept in view, left out of the next requests; Regenerate tries again
  } finally {
    state.controller = null;
  }
  if (!message.error) message.stats = stats(t0, first, performance.now(), usage, finish, pieces);
  touch(conversation);
  show();  // this conversation's final view, or the controls of the one switched to set idle
}

// A stopped answer has no usage (it comes at the end of the stream): its tokens are then counted as the pieces of
// text that came, one per token but where a piece was held back (a possible stop string), so marked approximate.
function stats(t0, first, end, usage, finish, pieces) {
  const tokens = usage ? usage.completion_tokens : pieces;
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  return { tokens, approximate: !usage, ttft_ms: first ? Math.round(first - t0) : null,
    tokens_per_s: tokens > 1 && end > first ? (tokens - 1) / ((end - first) / 1000) : null,
    cached: Number.isInteger(cached) ? `${cached} of ${usage.prompt_tokens}` : null,
    context: usage && state.props.n_ctx ? `${usage.total_tokens}/${state.props.n_ctx}` : null, finish };
}

function statsText(s) {
  const parts = [`${s.approximate ? "~" : ""}${s.tokens} token${s.tokens === 1 ? "" : "s"}`];
  if (s.tokens_per_s !== null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  if (s.ttft_ms !== null) parts.push(`TTFT ${s.ttft_ms} ms`);
  if (s.cached) parts.push(`cached ${s.cached} prompt tokens`);  // stats kept by an older page have none
  if (s.context) parts.push(`context ${s.context}`);
  if (s.finish === "length") parts.push("cut at max tokens");
  if (s.finish === "stopped") parts.push("stopped");
  return parts.join(" · ");
}

function stop() {
  if (state.controller) state.controller.abort();  // the server cancels the generation when the stream closes
}

// --- the settings, kept in this browser ---------------------------------------------------------------------------
function loadSettings() {
  const saved = readJson(localStorage, SETTINGS_STORE, {});
  for (const id of SETTING_IDS) $(id).value = saved[id] ?? "";
}

function saveSettings() {
  const values = Object.fromEntries(SETTING_IDS.map((id) => [id, $(id).value]).filter(([, v]) => v !== ""));
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
}

// --- the controls -------------------------------------------------------------------------------------------------
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller || !state.props) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") stop();
});

$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  switchTo(null);
  $("prompt").focus();
});
$("settings-toggle").addEventListener("click", () => {
  const open = $("settings").hidden;
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
});
for (const id of SETTING_IDS) $(id).addEventListener("input", saveSettings);
$("reset-settings").addEventListener("click", () => {
  for (const id of SETTING_IDS) $(id).value = "";
  saveSettings();
});

loadSettings();
show();
load();
