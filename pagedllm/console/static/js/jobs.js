// Training jobs over the job service's REST API (/v1/training/jobs, docs/jobs.md): the list,
// submission from a form or a pasted job file (TOML, sent as application/toml and read by the
// trainer's own parser, or JSON), and one job's status, loss and learning-rate curves,
// checkpoints, logs, and its cancel / checkpoint / resume actions.

import { del, getJSON, postJSON, send } from "./api.js";
import { LineChart } from "./chart.js";
import { $, every, fmtBytes, fmtNumber, fmtTime, h, showError } from "./dom.js";

const ACTIVE = new Set(["PENDING", "RUNNING", "CHECKPOINTING"]);
const LOG_KEEP = 200_000; // characters of log kept on the page

// The form: [section, field, label, kind, default]; kind "int" | "float" | "text" | [choices].
// Defaults: a small model on the standard library that trains in minutes. Paths are the server's:
// relative ones are under its data dir, others must be under an --allowed-path (docs/jobs.md).
const FORM = [
  ["", "job_name", "name", "text", "console-job"],
  ["data_config", "dataset_path", "dataset (file, folder, JSONL or @stdlib)", "text", "@stdlib"],
  ["data_config", "tokenizer_path", "tokenizer (folder or tokenizer.json, on the server)", "text", ""],
  ["model_config", "architecture", "architecture", ["llama", "mistral", "qwen2", "qwen3"], "llama"],
  ["model_config", "num_layers", "layers", "int", 2],
  ["model_config", "hidden_size", "hidden size", "int", 64],
  ["model_config", "num_attention_heads", "attention heads", "int", 4],
  ["model_config", "num_kv_heads", "KV heads", "int", 4],
  ["model_config", "intermediate_size", "MLP size", "int", 192],
  ["model_config", "vocab_size", "vocabulary", "int", 8192],
  ["model_config", "max_position_embeddings", "max positions", "int", 256],
  ["data_config", "sequence_length", "sequence length", "int", 128],
  ["data_config", "global_batch_size", "global batch", "int", 8],
  ["data_config", "micro_batch_size", "micro batch", "int", 8],
  ["data_config", "validation_split", "validation split", "float", 0.02],
  ["optimization_config", "learning_rate", "learning rate", "float", 0.003],
  ["optimization_config", "lr_scheduler", "schedule", ["COSINE", "LINEAR", "CONSTANT"], "COSINE"],
  ["optimization_config", "warmup_steps", "warm-up steps", "int", 10],
  ["optimization_config", "total_steps", "steps", "int", 200],
  ["parallelism_config", "data_parallel_size", "processes (data parallel)", "int", 1],
  ["checkpoint_config", "checkpoint_interval_steps", "checkpoint every (steps, empty: at the end)", "int", 50],
];

// The fine-tune preset: LoRA on the default model (SmolLM2-135M-Instruct) from a chat JSONL file
// ({"messages": [...]} per line) under the server's data dir; the adapter lands in the job's output
// in PEFT's format (docs/training.md: base_model, method, the data format).
const FINETUNE_PRESET = `job_name = "finetune-smollm2"

[finetune_config]
base_model = "@default"        # or a Hugging Face folder / .gguf file under an --allowed-path
method = "lora"                # full | lora | qlora
lora_rank = 8
lora_alpha = 16.0

[data_config]
dataset_path = "chat.jsonl"    # JSONL chat data; the base's tokenizer and chat template are used
sequence_length = 512
global_batch_size = 8
micro_batch_size = 4
validation_split = 0.1

[optimization_config]
learning_rate = 0.0002
warmup_steps = 10
total_steps = 100
`;

const fieldId = (section, field) => `job-${section || "top"}-${field}`;

function buildForm() {
  const form = $("#job-form");
  for (const [section, field, label, kind, value] of FORM) {
    const id = fieldId(section, field);
    const input = Array.isArray(kind)
      ? h("select", { id }, ...kind.map((c) => h("option", { value: c, selected: c === value }, c)))
      : h("input", { id, type: kind === "text" ? "text" : "number", step: kind === "float" ? "any" : "1", value,
          placeholder: kind === "text" ? "under the data dir or an --allowed-path" : null });
    form.append(h("label", {}, h("span", {}, label), input));
  }
  form.append(h("div", { class: "row" },
    h("button", { type: "submit" }, "Submit"),
    h("button", { type: "button", class: "quiet", onclick: () => toPaste(formBody()) }, "Edit as JSON")));
}

function formBody() {
  const body = {};
  for (const [section, field, , kind] of FORM) {
    const raw = $(`#${fieldId(section, field)}`).value.trim();
    if (raw === "") continue;
    const value = kind === "int" ? parseInt(raw, 10) : kind === "float" ? parseFloat(raw) : raw;
    if (section) (body[section] ??= {})[field] = value;
    else body[field] = value;
  }
  return body;
}

function toPaste(body) {
  $("#job-text").value = JSON.stringify(body, null, 2);
  showSubmit("paste");
}

function showSubmit(which) {
  $("#job-form").hidden = which !== "form";
  $("#job-paste").hidden = which !== "paste";
  for (const b of document.querySelectorAll("[data-submit]")) b.classList.toggle("active", b.dataset.submit === which);
}

async function submit(request) {
  const error = $("#submit-error");
  showError(error, null);
  try {
    const created = await request();
    await refreshList();
    select(created.job_id);
  } catch (err) {
    showError(error, err);
  }
}

function submitPaste() {
  const text = $("#job-text").value;
  const json = text.trimStart().startsWith("{");
  return submit(async () => (await send("/v1/training/jobs", {
    method: "POST",
    headers: { "Content-Type": json ? "application/json" : "application/toml" },
    body: text,
  })).json());
}

// ---- the list ----------------------------------------------------------------------------------

let jobs = [];
let selected = null; // JobDetail of the selected job

function statusBadge(status) {
  return h("span", { class: `badge ${status.toLowerCase()}` }, status);
}

async function refreshList() {
  jobs = (await getJSON("/v1/training/jobs")).data.reverse(); // newest first
  const body = $("#jobs-table tbody");
  body.replaceChildren(...jobs.map((job) => h("tr", {
    "data-job-id": job.job_id, class: selected?.id === job.job_id ? "selected" : null, onclick: () => select(job.job_id),
  },
  h("td", {}, h("b", {}, job.job_name), h("div", { class: "small mono" }, job.job_id.slice(0, 8))),
  h("td", {}, statusBadge(job.status)),
  h("td", {}, `${job.metrics.step ?? 0} / ${job.optimization_config.total_steps}`),
  h("td", {}, fmtNumber(job.metrics.loss)))));
  if (!jobs.length) body.append(h("tr", {}, h("td", { colspan: 4, class: "hint" }, "No job yet.")));
}

function select(jobId) {
  if (selected?.id === jobId) return;
  selected?.stop();
  selected = new JobDetail(jobId);
  for (const tr of document.querySelectorAll("#jobs-table tbody tr")) tr.classList.toggle("selected", tr.dataset.jobId === jobId);
}

// ---- one job -----------------------------------------------------------------------------------

class JobDetail {
  constructor(id) {
    this.id = id;
    this.path = `/v1/training/jobs/${id}`;
    this.metrics = [];
    this.runs = -1;
    this.logOffset = 0;
    this.checkpointKey = null;
    this.loss = new LineChart({
      id: "chart-loss", title: "Loss", yMin: null, xFormat: (s) => `${s}`, yFormat: (v) => v.toFixed(2),
      series: [{ name: "train", color: "#2563eb" }, { name: "validation", color: "#dc2626", dash: "4 3" }],
      emptyText: "no step yet",
    });
    this.lr = new LineChart({
      id: "chart-lr", title: "Learning rate", xFormat: (s) => `${s}`, yFormat: (v) => v.toExponential(1),
      series: [{ name: "lr", color: "#16a34a" }], emptyText: "no step yet",
    });
    this.header = h("div", { class: "job-header" });
    this.numbers = h("div", { class: "totals" });
    this.error = h("p", { class: "error", hidden: true });
    this.checkpoints = h("tbody");
    this.history = h("ol", { class: "history" });
    this.log = h("pre", { class: "log", id: "job-log" });
    $("#job-detail").replaceChildren(
      this.header, this.error, this.numbers,
      h("div", { class: "charts two" }, this.loss.el, this.lr.el),
      h("h3", {}, "Checkpoints"),
      h("table", { class: "table", id: "checkpoints-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "step"), h("th", {}, "status"), h("th", {}, "size"), h("th", {}, "saved"), h("th", {}, "checkpoint id"))),
        this.checkpoints),
      h("details", {}, h("summary", {}, "History"), this.history),
      h("h3", {}, "Log"), this.log,
    );
    this.stopPolling = every(1000, () => this.poll(), () => !$("#panel-jobs").hidden);
  }

  stop() {
    this.stopPolling();
  }

  async poll() {
    try {
      const view = await getJSON(this.path);
      if (this.view && this.view.status !== view.status) refreshList().catch(() => {});
      // an ended job changes no more: read its metrics, log and checkpoints once after it ended
      const settled = this.view && !ACTIVE.has(view.status) && this.view.updated_at === view.updated_at;
      this.view = view;
      if (settled) return;
      await Promise.all([this.pollMetrics(view), this.pollLog(), this.pollCheckpoints(view)]);
      this.render(view);
      showError(this.error, null);
    } catch (err) {
      showError(this.error, err);
    }
  }

  async pollMetrics(view) {
    if (view.runs.length !== this.runs) {
      // a new run (a resume) replaces the steps after its checkpoint: read everything again
      this.runs = view.runs.length;
      this.metrics = [];
    }
    const since = this.metrics.length ? this.metrics[this.metrics.length - 1].step : 0;
    const { data } = await getJSON(`${this.path}/metrics?since_step=${since}`);
    if (!data.length && this.metrics.length) return;
    this.metrics.push(...data);
    const train = this.metrics.map((m) => [m.step, m.loss]);
    const val = this.metrics.filter((m) => m.val_loss !== undefined && m.val_loss !== null).map((m) => [m.step, m.val_loss]);
    this.loss.setData([train, val]);
    this.lr.setData([this.metrics.map((m) => [m.step, m.lr])]);
  }

  async pollLog() {
    const chunk = await getJSON(`${this.path}/logs?offset=${this.logOffset}`);
    if (!chunk.text) return;
    const atBottom = this.log.scrollTop + this.log.clientHeight >= this.log.scrollHeight - 4;
    this.log.textContent = (this.log.textContent + chunk.text).slice(-LOG_KEEP);
    this.logOffset = chunk.next_offset;
    if (atBottom) this.log.scrollTop = this.log.scrollHeight;
  }

  async pollCheckpoints(view) {
    const key = `${view.status}:${view.metrics.last_checkpoint?.checkpoint_id}:${view.history.length}`;
    if (key === this.checkpointKey) return;
    const list = await getJSON(`${this.path}/checkpoints`);
    this.checkpointKey = key;
    this.checkpoints.replaceChildren(...list.map((c) => {
      const size = [...c.shards, ...c.optimizer_states].reduce((s, f) => s + (f.file_size_bytes || 0), 0);
      return h("tr", { "data-checkpoint": c.checkpoint_id, "data-status": c.status },
        h("td", {}, String(c.step)), h("td", {}, statusBadge(c.status)), h("td", {}, fmtBytes(size)),
        h("td", {}, new Date(c.timestamp).toLocaleTimeString()), h("td", { class: "mono small", title: c.path || "" }, c.checkpoint_id));
    }));
    if (!list.length) this.checkpoints.append(h("tr", {}, h("td", { colspan: 5, class: "hint" }, "none yet")));
  }

  render(view) {
    const m = view.metrics;
    const total = view.optimization_config.total_steps;
    const action = (label, name, run, enabled) => h("button", {
      class: name === "cancel" ? "danger" : "", "data-action": name, disabled: !enabled,
      onclick: async (event) => {
        event.target.disabled = true;
        try {
          await run();
          showError(this.error, null);
        } catch (err) {
          showError(this.error, err);
        }
        await this.poll();
        await refreshList();
      },
    }, label);
    const running = view.status === "RUNNING" || view.status === "CHECKPOINTING";
    this.header.replaceChildren(
      h("h2", {}, view.job_name, " ", statusBadge(view.status)),
      h("div", { class: "mono small" }, view.job_id),
      h("progress", { max: total, value: m.step ?? 0 }),
      h("div", { class: "row" },
        action("Checkpoint now", "checkpoint", () => postJSON(`${this.path}/checkpoint`), running && !view.cancel_requested),
        action("Cancel", "cancel", () => del(this.path), ACTIVE.has(view.status) && !view.cancel_requested),
        action("Resume", "resume", () => postJSON(`${this.path}/resume`), view.status === "FAILED" || view.status === "CANCELLED")),
      h("p", { class: "error", hidden: !view.failure_reason }, view.failure_reason || ""),
    );
    const items = [
      ["step", `${m.step ?? 0} / ${total}`], ["loss", fmtNumber(m.loss, 4)], ["validation loss", fmtNumber(m.val_loss, 4)],
      ["learning rate", m.lr == null ? "–" : m.lr.toExponential(2)], ["grad norm", fmtNumber(m.grad_norm)],
      ["tokens/s", fmtNumber(m.tokens_per_s)], ["tokens seen", fmtNumber(m.consumed_tokens)],
      ["processes", String(view.world_size)], ["started", fmtTime(Date.parse(view.started_at) / 1000)],
    ];
    this.numbers.replaceChildren(...items.map(([label, value]) => h("div", { class: "total", "data-total": label }, h("span", {}, label), h("b", {}, value))));
    this.history.replaceChildren(...view.history.map((c) => h("li", {}, `${new Date(c.at).toLocaleTimeString()} ${c.status}${c.reason ? ` — ${c.reason}` : ""}`)));
  }
}

export function initJobs() {
  buildForm();
  $("#job-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit(() => postJSON("/v1/training/jobs", formBody()));
  });
  $("#job-paste").addEventListener("submit", (event) => {
    event.preventDefault();
    submitPaste();
  });
  for (const b of document.querySelectorAll("[data-submit]")) b.addEventListener("click", () => showSubmit(b.dataset.submit));
  $("#preset-finetune").addEventListener("click", () => {
    $("#job-text").value = FINETUNE_PRESET;
    showSubmit("paste");
  });
  every(2000, () => refreshList().catch((err) => showError($("#submit-error"), err)), () => !$("#panel-jobs").hidden);
}
