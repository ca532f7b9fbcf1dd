// The chat playground: a conversation streamed from /v1/chat/completions (or a one-shot prompt
// from /v1/completions) with the OpenAI protocol the API serves to any client, sampling controls,
// and per-reply timing: time to first token, tokens, and generation speed.
//
// Speed is tokens / (time of the last chunk - time the request was sent), measured in the
// browser: it includes the prompt's prefill and the network, and cannot be inflated when the
// server coalesces several tokens into one chunk (which a rate between first and last chunk would
// be). The token count is the server's (stream_options.include_usage); while streaming, chunks
// stand in for tokens.

import { streamEvents } from "./api.js";
import { $, fmtSeconds, h, showError } from "./dom.js";

const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed"];
const INTEGERS = new Set(["top_k", "max_tokens", "seed"]);

let history = []; // [{role, content}] of the conversation so far
let controller = null; // AbortController of the reply being streamed

function sampling() {
  const params = {};
  for (const name of NUMBERS) {
    const raw = $(`#s-${name}`).value.trim();
    if (raw === "") continue;
    params[name] = INTEGERS.has(name) ? parseInt(raw, 10) : parseFloat(raw);
  }
  const stop = $("#s-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) params.stop = stop;
  return params;
}

function bubble(role, text = "") {
  const content = h("div", { class: "content" }, text);
  const meta = h("div", { class: "meta" });
  const el = h("div", { class: `message ${role}`, "data-role": role }, h("div", { class: "role" }, role), content, meta);
  $("#chat-empty").hidden = true;
  $("#chat-log").append(el);
  return { el, content, meta };
}

function scrollDown() {
  const log = $("#chat-log");
  log.scrollTop = log.scrollHeight;
}

class Timing {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.chunks = 0;
    this.tokens = null; // from usage, at the end
  }

  chunk() {
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.chunks++;
  }

  summary(finish) {
    const tokens = this.tokens ?? this.chunks;
    const parts = [];
    if (this.first !== null) parts.push(`TTFT ${fmtSeconds((this.first - this.start) / 1000)}`);
    parts.push(`${tokens} tokens${this.tokens === null ? " (chunks)" : ""}`);
    const span = (this.last - this.start) / 1000;
    if (tokens > 0 && span > 0) parts.push(`${(tokens / span).toFixed(1)} tok/s`);
    if (finish) parts.push(`finish: ${finish}`);
    return parts.join(" · ");
  }
}

async function send(text) {
  const model = $("#chat-model").value;
  if (!model) throw new Error("No model is loaded: load one in the Models tab.");
  const mode = $("#chat-mode").value;
  const params = { model, ...sampling(), stream_options: { include_usage: true } };
  let path;
  if (mode === "chat") {
    const system = $("#chat-system").value.trim();
    history.push({ role: "user", content: text });
    bubble("user", text);
    params.messages = [...(system ? [{ role: "system", content: system }] : []), ...history];
    if ($("#s-format").value === "json_object") params.response_format = { type: "json_object" };
    path = "/v1/chat/completions";
  } else {
    bubble("prompt", text);
    params.prompt = text;
    path = "/v1/completions";
  }
  const reply = bubble("assistant");
  reply.el.classList.add("streaming");
  const timing = new Timing();
  let finish = null;
  let answer = "";
  // Text is painted once per frame, not once per chunk: layout per chunk would slow the reading
  // of the stream (and the measured speed) to the page's rendering speed.
  let painting = false;
  const paint = () => {
    painting = false;
    reply.content.textContent = answer;
    scrollDown();
  };
  controller = new AbortController();
  setBusy(true);
  const speed = $("#chat-speed");
  try {
    await streamEvents(path, params, (event) => {
      if (event.usage) timing.tokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const piece = mode === "chat" ? choice.delta?.content : choice.text;
        if (piece) {
          timing.chunk();
          answer += piece;
          if (!painting) {
            painting = true;
            requestAnimationFrame(paint);
          }
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      speed.textContent = timing.summary(null);
    }, controller.signal);
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped by you";
    else {
      reply.el.classList.add("failed");
      throw error;
    }
  } finally {
    paint();
    reply.el.classList.remove("streaming");
    reply.meta.textContent = timing.summary(finish);
    speed.textContent = reply.meta.textContent;
    if (mode === "chat" && answer) history.push({ role: "assistant", content: answer });
    else if (mode === "chat") history.pop(); // no reply: the message is not part of the conversation
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("#chat-send").disabled = busy;
  $("#chat-stop").disabled = !busy;
}

function fillModels(models) {
  const select = $("#chat-model");
  const current = select.value;
  const served = models.filter((m) => m.status === "ready");
  const ready = served.map((m) => m.id);
  // a LoRA adapter is picked like a model, labelled with the base it runs over
  select.replaceChildren(...served.map((m) => h("option", { value: m.id }, m.parent ? `${m.id} (LoRA on ${m.parent})` : m.id)));
  if (!ready.length) select.append(h("option", { value: "" }, "(no model loaded)"));
  if (ready.includes(current)) select.value = current;
  $("#chat-served").textContent = select.value || "a model (none is loaded)";
}

function showMode() {
  const chat = $("#chat-mode").value === "chat";
  for (const el of document.querySelectorAll(".chat-only")) el.hidden = !chat;
}

export function initChat() {
  const text = $("#chat-text");
  $("#chat-model").addEventListener("change", () => { $("#chat-served").textContent = $("#chat-model").value; });
  const error = $("#chat-error");
  $("#chat-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const message = text.value.trim();
    if (!message || controller) return;
    text.value = "";
    showError(error, null);
    try {
      await send(message);
    } catch (err) {
      showError(error, err);
    }
  });
  text.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("#chat-form").requestSubmit();
    }
  });
  $("#chat-stop").addEventListener("click", () => controller?.abort());
  $("#chat-clear").addEventListener("click", () => {
    controller?.abort();
    history = [];
    for (const el of document.querySelectorAll("#chat-log .message")) el.remove();
    $("#chat-empty").hidden = false;
    $("#chat-speed").textContent = "";
  });
  $("#chat-mode").addEventListener("change", showMode);
  document.addEventListener("models-changed", (event) => fillModels(event.detail));
  showMode();
  fillModels([]);
}
