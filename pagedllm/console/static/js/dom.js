// Small DOM and formatting helpers shared by the panels.

// h("button", {class: "x", onclick: f}, "text", child) -> element
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : value);
  }
  el.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

export const $ = (selector, root = document) => root.querySelector(selector);

export function fmtNumber(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (abs >= 1e6) return (value / 1e6).toFixed(2) + "M";
  if (abs >= 1e4) return (value / 1e3).toFixed(1) + "k";
  if (abs >= 100) return value.toFixed(0);
  if (abs >= 0.01) return String(Number(value.toPrecision(digits)));
  return value.toExponential(2);
}

export function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  return seconds < 1 ? `${(seconds * 1000).toFixed(0)} ms` : `${seconds.toFixed(2)} s`;
}

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) {
    bytes /= 1024;
    i++;
  }
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function fmtTime(unixSeconds) {
  if (!unixSeconds) return "–";
  return new Date(unixSeconds * 1000).toLocaleTimeString();
}

// Shows `error` (an ApiError or any Error) in `target`, or clears it when error is null.
export function showError(target, error) {
  target.textContent = error ? error.message + (error.param ? ` (${error.param})` : "") : "";
  target.hidden = !error;
}

// Runs `tick` now and every `ms` (a number, or a function giving it each time) while `active()`
// holds; returns a stop function. A tick that takes longer than `ms` is not overlapped by the next.
export function every(ms, tick, active = () => true) {
  let stopped = false;
  let timer = null;
  const loop = async () => {
    if (stopped) return;
    if (active() && !document.hidden) {
      try {
        await tick();
      } catch (error) {
        console.warn(error);
      }
    }
    if (!stopped) timer = setTimeout(loop, typeof ms === "function" ? ms() : ms);
  };
  loop();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
