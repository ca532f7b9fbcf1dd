// The Requests panel: every unfinished request of every loaded model with its state — queued,
// prefilling, decoding, preempted — its timings and counts (GET /v1/requests, behind the API key),
// refreshed every second while the panel is shown.

import { getJSON } from "./api.js";
import { $, every, h, showError } from "./dom.js";

function seconds(value) {
  return value == null ? "" : `${value.toFixed(2)} s`;
}

function row(request) {
  const now = Date.now() / 1000;
  return h(
    "tr",
    { "data-request": request.id, "data-status": request.status },
    h("td", {}, h("code", {}, request.id)),
    h("td", {}, request.model),
    h("td", {}, h("span", { class: `badge ${request.status}` }, request.status)),
    h("td", {}, seconds(now - request.arrival_time)),
    h("td", {}, seconds(request.queue_time_s)),
    h("td", {}, `${request.num_prompt_tokens} → ${request.num_generated_tokens}`),
    h("td", {}, String(request.num_samples)),
    h("td", {}, String(request.num_preemptions)),
  );
}

async function refresh() {
  const requests = (await getJSON("/v1/requests")).data;
  const body = $("#requests-table tbody");
  body.replaceChildren(...requests.map(row));
  if (!requests.length) body.append(h("tr", {}, h("td", { colspan: 8, class: "hint" }, "No request is running or waiting.")));
  showError($("#requests-error"), null);
}

export function initRequests() {
  every(1000, () => refresh().catch((err) => showError($("#requests-error"), err)), () => !$("#panel-requests").hidden);
}
