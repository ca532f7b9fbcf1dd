// A small SVG line chart: a few series of (x, y) points, axes with round ticks, a legend that
// shows each series' latest value. Hand-written (about 150 lines) rather than a charting library:
// the console needs only lines, it must work offline with no build step, and every element is
// plain SVG a browser test can read (each line carries data-series and data-count).

import { h } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 420;
const H = 170;
const M = { left: 48, right: 10, top: 10, bottom: 22 };

function s(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Round tick values covering [lo, hi], about `count` of them.
export function ticks(lo, hi, count = 4, minStep = 0) {
  if (!(hi > lo)) hi = lo + Math.max(1, minStep * count);
  const raw = Math.max((hi - lo) / count, minStep);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((v) => v >= raw && (minStep < 1 || Number.isInteger(v)));
  const first = Math.ceil(lo / step - 1e-9) * step;
  const out = [];
  for (let v = first; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

export class LineChart {
  // series: [{name, color, dash?}]; yFormat/xFormat: value -> label; yMin/yMax fix the y range
  // (null: from the data); yStep: the smallest y tick step (1 for counts); emptyText: shown while
  // there is no point.
  constructor({ title, series, yFormat = String, xFormat = String, yMin = 0, yMax = null, yStep = 0, id, emptyText = "no data yet" }) {
    this.yStep = yStep;
    this.series = series;
    this.yFormat = yFormat;
    this.xFormat = xFormat;
    this.yMin = yMin;
    this.yMax = yMax;
    this.emptyText = emptyText;
    this.data = series.map(() => []);
    this.svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
    this.legend = h("div", { class: "legend" });
    this.el = h("figure", { class: "chart", id }, h("figcaption", {}, title), this.svg, this.legend);
    this.render();
  }

  // points[i]: [[x, y], ...] of series i (y null: a gap)
  setData(points) {
    this.data = points.map((p) => p.filter(([x, y]) => Number.isFinite(x) && (y === null || Number.isFinite(y))));
    this.render();
  }

  render() {
    const svg = this.svg;
    svg.replaceChildren();
    const all = this.data.flat().filter(([, y]) => y !== null);
    const plot = { x0: M.left, x1: W - M.right, y0: H - M.bottom, y1: M.top };
    svg.append(s("rect", { x: plot.x0, y: plot.y1, width: plot.x1 - plot.x0, height: plot.y0 - plot.y1, class: "plot" }));
    if (all.length === 0) {
      svg.append(s("text", { x: (plot.x0 + plot.x1) / 2, y: (plot.y0 + plot.y1) / 2, class: "empty", "text-anchor": "middle" }, this.emptyText));
      this.renderLegend();
      return;
    }
    const xs = all.map(([x]) => x);
    const ys = all.map(([, y]) => y);
    let xLo = Math.min(...xs);
    let xHi = Math.max(...xs);
    if (xHi === xLo) xHi = xLo + 1;
    let yLo = this.yMin ?? Math.min(...ys);
    let yHi = this.yMax ?? Math.max(...ys);
    if (this.yMin === null && this.yMax === null && yHi - yLo < 1e-12) {
      yLo -= 0.5;
      yHi += 0.5;
    }
    const yTicks = ticks(Math.min(yLo, ...ys), Math.max(yHi, ...ys), 4, this.yStep);
    yLo = Math.min(yLo, yTicks[0]);
    yHi = Math.max(yHi, yTicks[yTicks.length - 1]);
    const px = (x) => plot.x0 + ((x - xLo) / (xHi - xLo)) * (plot.x1 - plot.x0);
    const py = (y) => plot.y0 - ((y - yLo) / (yHi - yLo || 1)) * (plot.y0 - plot.y1);
    for (const t of yTicks) {
      svg.append(s("line", { x1: plot.x0, x2: plot.x1, y1: py(t), y2: py(t), class: "grid" }));
      svg.append(s("text", { x: plot.x0 - 4, y: py(t) + 3, "text-anchor": "end", class: "tick" }, this.yFormat(t)));
    }
    for (const t of ticks(xLo, xHi, 4)) {
      svg.append(s("text", { x: px(t), y: H - 6, "text-anchor": "middle", class: "tick" }, this.xFormat(t)));
    }
    this.series.forEach((series, i) => {
      const points = this.data[i] || [];
      const segments = [[]];
      for (const [x, y] of points) {
        if (y === null) segments.push([]);
        else segments[segments.length - 1].push(`${px(x).toFixed(1)},${py(y).toFixed(1)}`);
      }
      const count = points.filter(([, y]) => y !== null).length;
      const group = s("g", { "data-series": series.name, "data-count": count });
      for (const segment of segments.filter((seg) => seg.length)) {
        const attrs = { points: segment.join(" "), stroke: series.color, class: "line" };
        if (series.dash) attrs["stroke-dasharray"] = series.dash;
        group.append(s("polyline", attrs));
        if (segment.length === 1) {
          const [cx, cy] = segment[0].split(",");
          group.append(s("circle", { cx, cy, r: 2.5, fill: series.color }));
        }
      }
      svg.append(group);
    });
    this.renderLegend();
  }

  renderLegend() {
    this.legend.replaceChildren(
      ...this.series.map((series, i) => {
        const last = [...(this.data[i] || [])].reverse().find(([, y]) => y !== null);
        return h(
          "span",
          { class: "key", "data-series": series.name },
          h("i", { style: `background:${series.color}` }),
          `${series.name} `,
          h("b", {}, last ? this.yFormat(last[1]) : "–"),
        );
      }),
    );
  }
}
