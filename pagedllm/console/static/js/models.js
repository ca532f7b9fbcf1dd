// The Models panel: every model the server can serve, with load / unload.
//
// Listing: GET /console/api/models (loaded, loading, failed and loadable models). Loading:
// POST /v1/models/{id}/load (202 while it loads; the list is polled until it is ready or failed).
// Unloading: DELETE /v1/models/{id} (requests in flight end with finish_reason "abort").
// Other panels listen for the "models-changed" event to refresh their model pickers.

import { del, getJSON, postJSON } from "./api.js";
import { $, every, h, showError } from "./dom.js";

let last = "";

export async function listModels() {
  return (await getJSON("/console/api/models")).data;
}

function announce(models) {
  const signature = JSON.stringify(models.map((m) => [m.id, m.status]));
  if (signature !== last) {
    last = signature;
    document.dispatchEvent(new CustomEvent("models-changed", { detail: models }));
  }
}

async function act(action) {
  const error = $("#models-error");
  try {
    showError(error, null);
    await action();
  } catch (err) {
    showError(error, err);
  }
  await refresh();
}

function row(model) {
  const id = encodeURIComponent(model.id);
  const load = () => act(() => postJSON(`/v1/models/${id}/load`));
  const unload = () => act(() => del(`/v1/models/${id}`));
  const button =
    model.status === "ready"
      ? h("button", { class: "quiet", onclick: unload, "data-action": "unload" }, "Unload")
      : model.status === "loading"
        ? h("button", { disabled: true }, "Loading…")
        : h("button", { onclick: load, "data-action": "load" }, model.status === "failed" ? "Retry" : "Load");
  return h(
    "tr",
    { "data-model": model.id, "data-status": model.status },
    h("td", {}, h("b", {}, model.id)),
    h("td", {}, h("span", { class: `badge ${model.status}` }, model.status), model.error ? h("div", { class: "error small" }, model.error) : null),
    h("td", {}, model.parent ? `LoRA adapter on ${model.parent}` : model.max_model_len ? `${model.max_model_len} tokens` : ""),
    h("td", {}, button),
  );
}

async function refresh() {
  const models = await listModels();
  const body = $("#models-table tbody");
  body.replaceChildren(...models.map(row));
  if (!models.length) body.append(h("tr", {}, h("td", { colspan: 4, class: "hint" }, "No model: start the server with --model or --model-dir.")));
  announce(models);
  return models;
}

export function initModels() {
  const visible = () => !$("#panel-models").hidden;
  // Fast while something is loading or the panel is shown; otherwise a slow background check keeps
  // the other panels' pickers current.
  every(1000, () => refresh().catch((err) => showError($("#models-error"), err)), () => visible() || last.includes('"loading"'));
  every(10000, refresh, () => !visible());
  document.addEventListener("key-changed", () => refresh().catch(() => {}));
}
