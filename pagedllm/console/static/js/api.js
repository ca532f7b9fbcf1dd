// Talking to the server: the API key, JSON calls with OpenAI-shaped errors, and SSE streams.
//
// The key is kept in localStorage (as llama.cpp's web UI does) and sent as
// `Authorization: Bearer KEY` on every call, exactly as an API client sends it. A 401 asks the
// page for a key (the handler installed by onKeyNeeded) and retries once with it.

const KEY_STORAGE = "pagedllm.apiKey";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
  }
}

let keyNeeded = async () => false;

export function onKeyNeeded(handler) {
  keyNeeded = handler;
}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's page, say): the status alone
  }
  return new ApiError(response.status, body);
}

// fetch() with the key; on 401, ask for a key once and retry.
export async function send(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(path, { ...options, headers: headers(options.headers) });
    if (response.status === 401 && attempt === 0 && (await keyNeeded())) continue;
    if (!response.ok) throw await errorFrom(response);
    return response;
  }
}

// Checks a key without storing it: true when the server accepts it (or needs none).
export async function keyWorks(key) {
  const response = await fetch("/v1/models", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
  return response.status !== 401;
}

export async function getJSON(path) {
  return (await send(path)).json();
}

export async function postJSON(path, body, method = "POST") {
  const options = { method, headers: { "Content-Type": "application/json" } };
  if (body !== undefined) options.body = JSON.stringify(body);
  return (await send(path, options)).json();
}

export async function del(path) {
  return (await send(path, { method: "DELETE" })).json();
}

// POSTs `body` with stream=true and calls onEvent(json) for each `data:` event until [DONE].
// An error event ({"error": ...}) mid-stream is thrown as an ApiError, as the openai client does.
export async function streamEvents(path, body, onEvent, signal) {
  const response = await send(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const json = JSON.parse(data);
      if (json.error) throw new ApiError(500, json);
      onEvent(json);
    }
  }
}
