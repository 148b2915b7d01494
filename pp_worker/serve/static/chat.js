// The chat page of pp-serve: a conversation streamed from /v1/chat/completions (SSE read from fetch, since
// EventSource cannot POST). It reads the model and its context from /props, and asks for the API key when the
// server answers 401, keeping it for this tab (sessionStorage) so it is asked for once.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pp-serve-api-key";
const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  props: null,
  history: [],        // the turns sent with the next request: {role, content}
  controller: null,   // the answer in progress (AbortController), null when idle
};

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
  if (response.status === 503) {  // warming up, or the stages restarting: it will answer soon
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
  $("temperature").placeholder = `server default (${params.temperature ?? "0: greedy"})`;
  $("max-tokens").placeholder = `server default (${params.n_predict ?? "?"})`;
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

// --- the conversation ---------------------------------------------------------------------------------------------
function addMessage(role, text) {
  $("empty").hidden = true;
  const box = document.createElement("article");
  box.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;  // text, never HTML: a model's answer is not trusted markup
  box.append(body);
  $("conversation").append(box);
  scrollDown();
  return box;
}

function scrollDown() {
  const view = $("conversation");
  view.scrollTop = view.scrollHeight;
}

function note(box, text, kind = "stats") {
  const line = document.createElement("div");
  line.className = kind;
  line.textContent = text;
  box.append(line);
  scrollDown();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("send").disabled = busy || !state.props;
  $("prompt").disabled = !state.props;
}

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

function request(messages) {
  const body = { model: state.props.model, messages, stream: true, stream_options: { include_usage: true } };
  if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
  if ($("max-tokens").value !== "") body.max_tokens = Number($("max-tokens").value);
  return body;
}

// One answer: streamed into its bubble; under it the tokens, tokens/s and time to first token, measured here (what
// the reader waited), the decode rate over the tokens after the first.
async function send(text) {
  const user = { role: "user", content: text };
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, user];
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const shown = box.querySelector(".text");
  const t0 = performance.now();
  let first = 0, answer = "", usage = null, finish = "", failed = "";
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(request(messages)), signal: state.controller.signal });
    if (response.status === 401) askKey("The server refused the key; enter it again, then resend.");
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of events(response.body)) {
      if (event.error) throw new Error(event.error.message);
      usage = event.usage || usage;
      const choice = (event.choices || [])[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        first = first || performance.now();
        answer += piece;
        shown.textContent = answer.trimStart();  // a model's answer often starts with the space of its first word
        scrollDown();
      }
      finish = (choice && choice.finish_reason) || finish;
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else failed = e.message;
  } finally {
    state.controller = null;
    box.classList.remove("streaming");
    setBusy(false);
  }
  if (failed) {
    note(box, failed, "error");
    return;  // the turn stays out of the history: the next request does not carry it
  }
  state.history.push(user, { role: "assistant", content: answer });
  note(box, stats(t0, first, performance.now(), usage, finish));
}

function stats(t0, first, end, usage, finish) {
  const parts = [];
  const n = usage && usage.completion_tokens;
  if (n) parts.push(`${n} token${n === 1 ? "" : "s"}`);
  if (n > 1 && end > first) parts.push(`${((n - 1) / ((end - first) / 1000)).toFixed(1)} tok/s`);
  if (first) parts.push(`TTFT ${Math.round(first - t0)} ms`);
  if (usage && state.props.n_ctx) parts.push(`context ${usage.total_tokens}/${state.props.n_ctx}`);
  if (finish === "length") parts.push("cut at max tokens");
  if (finish === "stopped") parts.push("stopped");
  return parts.join(" · ");
}

function stop() {
  if (state.controller) state.controller.abort();  // the server cancels the generation when the stream closes
}

function clear() {
  stop();
  state.history = [];
  for (const box of $("conversation").querySelectorAll(".message")) box.remove();
  $("empty").hidden = false;
  $("prompt").focus();
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
$("clear").addEventListener("click", clear);
$("settings-toggle").addEventListener("click", () => {
  const open = $("settings").hidden;
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
});

load();
