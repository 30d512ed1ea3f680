// The chat page: a conversation kept in the page, each reply streamed from /v1/chat/completions (fetch and a stream
// reader: EventSource cannot POST); Stop aborts the request, which the server sees as a disconnect and aborts too.
import { KeyNeeded, api, el, errorText, setUpKeyDialog, whenKeySaved } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
let history = []; // the conversation as the API takes it
let inFlight = null; // the AbortController of the reply streaming now

async function loadModels() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const { data } = await response.json();
    $("model").replaceChildren(...data.map((m) => el("option", "", m.id)));
  } catch (error) {
    if (!(error instanceof KeyNeeded)) showNote(`Could not list the models: ${error.message}`);
  }
}

function showNote(text) {
  $("messages").append(el("p", "error", text));
}

function addMessage(role, text) {
  $("messages").querySelector(".empty")?.remove();
  const box = el("div", `msg ${role}`);
  box.append(el("div", "role", role));
  const content = el("div", role === "user" ? "text" : "content", role === "user" ? text : undefined);
  box.append(content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

// What the request asks for besides the conversation, from the side panel.
function requestOptions() {
  const options = { model: $("model").value, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) options.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) options.max_tokens = maxTokens;
  const seed = parseInt($("seed").value, 10);
  if (!Number.isNaN(seed)) options.seed = seed;
  const format = $("format").value;
  if (format === "json_object") options.response_format = { type: "json_object" };
  if (format === "json_schema") {
    options.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse($("schema").value) } };
  }
  return options;
}

// One streamed reply: its text, reasoning and tool calls as they arrive, then its usage and speed.
class Reply {
  constructor(box) {
    this.box = box;
    this.content = box.querySelector(".content");
    this.text = "";
    this.reasoning = "";
    this.toolCalls = [];
    this.started = performance.now();
    this.firstToken = null;
    this.usage = null;
    this.finish = null;
    this.pending = false;
  }

  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return;
    const delta = choice.delta || {};
    if (delta.content || delta.reasoning_content || delta.tool_calls) this.firstToken ??= performance.now();
    this.text += delta.content || "";
    this.reasoning += delta.reasoning_content || "";
    for (const call of delta.tool_calls || []) {
      const known = (this.toolCalls[call.index] ??= { id: call.id, type: "function", function: { name: "", arguments: "" } });
      known.function.name += call.function?.name || "";
      known.function.arguments += call.function?.arguments || "";
    }
    if (choice.finish_reason) this.finish = choice.finish_reason;
    if (!this.pending) { // at most one render a frame, however fast chunks come
      this.pending = true;
      requestAnimationFrame(() => this.render());
    }
  }

  render() {
    this.pending = false;
    this.content.replaceChildren(renderMarkdown(this.text));
    if (this.reasoning) {
      let details = this.box.querySelector("details.reasoning");
      if (!details) {
        details = el("details", "reasoning");
        details.append(el("summary", "", "reasoning"), el("div"));
        this.box.insertBefore(details, this.content);
      }
      details.lastChild.textContent = this.reasoning;
    }
    this.box.querySelectorAll(".tool-call").forEach((node) => node.remove());
    for (const call of this.toolCalls) {
      this.box.append(el("div", "tool-call", `tool call ${call.function.name}(${call.function.arguments})`));
    }
    this.box.scrollIntoView({ block: "end" });
  }

  done(note) {
    this.render();
    const end = performance.now();
    const parts = [];
    if (this.usage) {
      const tokens = this.usage.completion_tokens;
      parts.push(`${this.usage.prompt_tokens} prompt tokens`, `${tokens} tokens`);
      if (this.firstToken !== null && tokens > 1 && end > this.firstToken) {
        parts.push(`${((tokens - 1) / ((end - this.firstToken) / 1000)).toFixed(1)} tok/s`);
      }
    }
    if (this.firstToken !== null) parts.push(`first token ${((this.firstToken - this.started) / 1000).toFixed(2)} s`);
    if (this.finish && this.finish !== "stop") parts.push(`finish: ${this.finish}`);
    if (note) parts.push(note);
    this.box.append(el("div", "meta", parts.join(" · ")));
  }

  message() {
    const message = { role: "assistant", content: this.text };
    if (this.toolCalls.length) message.tool_calls = this.toolCalls;
    return message;
  }
}

// Server-sent events from a fetch body: `data: {...}` lines, blank-line separated, ending with `data: [DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  const turns = history; // this question's conversation, even if New chat starts another meanwhile
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = new Reply(addMessage("assistant"));
  inFlight = new AbortController();
  setBusy(true);
  let note = "";
  let failed = false;
  try {
    const messages = system ? [{ role: "system", content: system }, ...turns] : turns;
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify({ ...requestOptions(), messages }), signal: inFlight.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      reply.add(chunk);
    }
  } catch (error) {
    if (error.name === "AbortError") note = "stopped"; // what came so far stays in the conversation
    else {
      failed = true;
      reply.box.append(el("div", "error", error instanceof KeyNeeded ? "This server needs an API key." : error.message));
    }
  } finally {
    inFlight = null;
    setBusy(false);
  }
  reply.done(note);
  if (failed) turns.pop(); // a question that got no answer is not sent again with the next one
  else turns.push(reply.message());
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function setUp() {
  setUpKeyDialog();
  whenKeySaved(loadModels);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || inFlight) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => inFlight?.abort());
  $("new-chat").addEventListener("click", () => {
    inFlight?.abort();
    history = [];
    $("messages").replaceChildren(el("p", "empty muted", "Ask the model something."));
  });
  $("format").addEventListener("change", () => { $("schema-box").hidden = $("format").value !== "json_schema"; });
  loadModels();
}

setUp();
