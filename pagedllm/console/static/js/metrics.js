// Live engine metrics: /console/api/stats polled every second (or as often as the picker says),
// the last 300 readings kept, and
// rates derived from the difference of consecutive readings (the counters are cumulative, as
// in /metrics): tokens/s, the prefix-cache hit rate and the mean TTFT / inter-token latency of
// each interval. "All models" sums the engines' counters.

import { getJSON } from "./api.js";
import { LineChart } from "./chart.js";
import { $, every, fmtNumber, fmtSeconds, h, showError } from "./dom.js";

const KEEP = 300;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"];

const readings = []; // [{time, models: [ModelStats]}]

const SUMMED = ["num_running", "num_waiting", "num_swapped", "kv_blocks_used", "kv_blocks_total", "prefix_cache_queries",
  "prefix_cache_hits", "num_preemptions", "prompt_tokens_total", "generation_tokens_total"];

// One model's stats in a reading, or the sum over all its models ("" = all); null if absent.
function pick(reading, model) {
  const rows = reading.models.filter((m) => !model || m.model === model);
  if (!rows.length && model) return null; // that model was not loaded then
  const out = { latency_seconds: {} };
  for (const key of SUMMED) out[key] = rows.reduce((sum, m) => sum + m[key], 0);
  for (const name of ["ttft", "itl", "e2e", "queue"]) {
    out.latency_seconds[name] = {
      sum: rows.reduce((s, m) => s + (m.latency_seconds[name]?.sum ?? 0), 0),
      count: rows.reduce((s, m) => s + (m.latency_seconds[name]?.count ?? 0), 0),
    };
  }
  return out;
}

const ratio = (num, den) => (den > 0 ? num / den : null);
const rate = (delta, seconds) => (delta >= 0 && seconds > 0 ? delta / seconds : null); // < 0: a model reloaded

function latencyMean(prev, cur, name) {
  const a = prev.latency_seconds[name] ?? { sum: 0, count: 0 };
  const b = cur.latency_seconds[name] ?? { sum: 0, count: 0 };
  return b.count > a.count ? (b.sum - a.sum) / (b.count - a.count) : null;
}

// Each chart: series and a function (previous, current, seconds between) -> one y per series.
const CHARTS = [
  {
    id: "chart-requests", title: "Requests", yFormat: (v) => fmtNumber(v), yStep: 1,
    series: ["running", "waiting", "swapped"],
    values: (_, c) => [c.num_running, c.num_waiting, c.num_swapped],
  },
  {
    id: "chart-kv", title: "KV cache blocks used", yFormat: (v) => fmtNumber(v), yStep: 1,
    series: ["used"],
    values: (_, c) => [c.kv_blocks_used],
  },
  {
    id: "chart-prefix", title: "Prefix-cache hit rate", yFormat: (v) => `${(v * 100).toFixed(0)}%`, yMax: 1,
    series: ["interval", "since start"],
    values: (p, c) => [ratio(c.prefix_cache_hits - p.prefix_cache_hits, c.prefix_cache_queries - p.prefix_cache_queries),
      ratio(c.prefix_cache_hits, c.prefix_cache_queries)],
  },
  {
    id: "chart-throughput", title: "Throughput (tokens/s)", yFormat: (v) => fmtNumber(v),
    series: ["generated", "prompt"],
    values: (p, c, dt) => [rate(c.generation_tokens_total - p.generation_tokens_total, dt),
      rate(c.prompt_tokens_total - p.prompt_tokens_total, dt)],
  },
  {
    id: "chart-ttft", title: "Time to first token (mean)", yFormat: fmtSeconds,
    series: ["interval", "since start"],
    values: (p, c) => [latencyMean(p, c, "ttft"), ratio(c.latency_seconds.ttft.sum, c.latency_seconds.ttft.count)],
  },
  {
    id: "chart-itl", title: "Inter-token latency (mean)", yFormat: fmtSeconds,
    series: ["interval", "since start"],
    values: (p, c) => [latencyMean(p, c, "itl"), ratio(c.latency_seconds.itl.sum, c.latency_seconds.itl.count)],
  },
];

let charts = [];

function render() {
  const model = $("#metrics-model").value;
  const latest = readings.length ? readings[readings.length - 1].time : 0;
  const series = CHARTS.map((spec) => spec.series.map(() => []));
  for (let i = 1; i < readings.length; i++) {
    const prev = pick(readings[i - 1], model);
    const cur = pick(readings[i], model);
    const x = readings[i].time - latest;
    CHARTS.forEach((spec, k) => {
      const ys = prev && cur ? spec.values(prev, cur, readings[i].time - readings[i - 1].time) : spec.series.map(() => null);
      ys.forEach((y, j) => series[k][j].push([x, y]));
    });
  }
  charts.forEach((chart, k) => chart.setData(series[k]));
  renderTotals(readings.length ? pick(readings[readings.length - 1], model) : null);
}

function renderTotals(now) {
  const items = now
    ? [
        ["generated tokens", now.generation_tokens_total],
        ["prompt tokens", now.prompt_tokens_total],
        ["KV blocks used", `${now.kv_blocks_used} / ${now.kv_blocks_total}`],
        ["prefix-cache hits", `${fmtNumber(now.prefix_cache_hits)} / ${fmtNumber(now.prefix_cache_queries)} tokens`],
        ["preemptions", now.num_preemptions],
        ["requests timed", now.latency_seconds.e2e?.count ?? 0],
      ]
    : [];
  $("#metrics-totals").replaceChildren(
    ...items.map(([label, value]) => h("div", { class: "total", "data-total": label }, h("span", {}, label), h("b", {}, String(value)))),
  );
}

async function poll() {
  const reading = await getJSON("/console/api/stats");
  showError($("#metrics-error"), null);
  readings.push(reading);
  while (readings.length > KEEP) readings.shift();
  if (!$("#panel-metrics").hidden) render();
}

function fillModels(models) {
  const select = $("#metrics-model");
  const current = select.value;
  const ready = models.filter((m) => m.status === "ready" && !m.parent).map((m) => m.id); // (an adapter's steps are its base's)
  select.replaceChildren(h("option", { value: "" }, "all models"), ...ready.map((id) => h("option", { value: id }, id)));
  select.value = ready.includes(current) ? current : "";
}

export function initMetrics() {
  charts = CHARTS.map((spec) => new LineChart({
    id: spec.id, title: spec.title, yFormat: spec.yFormat, yMax: spec.yMax ?? null, yStep: spec.yStep ?? 0,
    xFormat: (t) => `${Math.round(t)}s`, emptyText: "waiting for readings…",
    series: spec.series.map((name, i) => ({ name, color: COLORS[i] })),
  }));
  $("#metrics-charts").append(...charts.map((c) => c.el));
  $("#metrics-model").addEventListener("change", render);
  document.addEventListener("models-changed", (event) => fillModels(event.detail));
  document.addEventListener("tab-shown", (event) => event.detail === "metrics" && render());
  // Collected all along (cheap), so the history is there when the tab is opened.
  every(() => Number($("#metrics-period").value), () => poll().catch((err) => showError($("#metrics-error"), err)));
}
