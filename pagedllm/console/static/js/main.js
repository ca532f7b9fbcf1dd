// The console's entry point: tabs, the API-key dialog, the health badge, and the five panels.

import { apiKey, keyWorks, onKeyNeeded, setApiKey } from "./api.js";
import { initChat } from "./chat.js";
import { $, every, showError } from "./dom.js";
import { initJobs } from "./jobs.js";
import { initMetrics } from "./metrics.js";
import { initModels } from "./models.js";
import { initRequests } from "./requests.js";

const TABS = ["chat", "models", "requests", "metrics", "jobs"];

function currentTab() {
  const tab = location.hash.slice(1);
  return TABS.includes(tab) ? tab : "chat";
}

function showTab() {
  const tab = currentTab();
  for (const name of TABS) $(`#panel-${name}`).hidden = name !== tab;
  for (const link of document.querySelectorAll("#tabs a")) link.classList.toggle("active", link.dataset.tab === tab);
  document.dispatchEvent(new CustomEvent("tab-shown", { detail: tab }));
}

// The key dialog. Every caller that meets a 401 while it is open waits on the same answer; once
// the user cancels it, 401s stop opening it until the "API key" button is pressed.
let pendingKey = null;
let declined = false;

function askForKey(reason = "") {
  if (pendingKey) return pendingKey;
  const dialog = $("#key-dialog");
  const input = $("#key-input");
  const error = $("#key-error");
  input.value = "";
  showError(error, reason ? new Error(reason) : null);
  pendingKey = new Promise((resolve) => {
    const finish = (ok) => {
      dialog.close();
      $("#key-form").onsubmit = $("#key-cancel").onclick = dialog.oncancel = null;
      pendingKey = null;
      resolve(ok);
    };
    $("#key-form").onsubmit = async (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (await keyWorks(key)) {
        setApiKey(key);
        finish(true);
        document.dispatchEvent(new Event("key-changed"));
      } else {
        showError(error, new Error("The server refused this key."));
        input.select();
      }
    };
    $("#key-cancel").onclick = dialog.oncancel = (event) => {
      event.preventDefault();
      declined = true;
      finish(false);
    };
  });
  dialog.showModal();
  input.focus();
  return pendingKey;
}

async function checkHealth() {
  const badge = $("#health");
  try {
    const response = await fetch("/health");
    const body = await response.json();
    badge.textContent = body.status;
    badge.className = `badge ${body.status}`;
    const reasons = Object.entries(body.models || {})
      .filter(([, m]) => m.reason)
      .map(([name, m]) => `${name}: ${m.reason}`);
    badge.title = reasons.join("\n") || "GET /health";
  } catch {
    badge.textContent = "offline";
    badge.className = "badge unhealthy";
  }
}

async function start() {
  onKeyNeeded(async () => !declined && askForKey(apiKey() ? "The stored key was refused." : ""));
  $("#key-button").addEventListener("click", () => {
    declined = false;
    askForKey();
  });
  $("#key-forget").addEventListener("click", () => {
    setApiKey("");
    $("#key-input").value = "";
  });
  window.addEventListener("hashchange", showTab);
  initChat();
  initModels();
  initRequests();
  initMetrics();
  initJobs();
  showTab();
  every(5000, checkHealth);
}

start();
