// The lilo console: signs in with an API key (kept in this tab's sessionStorage only), then polls
// GET /api/v1/console/overview and draws its tables and each model's critical-path bar. No library, no build step.
"use strict";

const KEY_ITEM = "lilo.console.key";
const READER_ITEM = "lilo.console.reader";
const REFRESH_MS = 3000;
// Each poll answers one interval per model (since this tab's reader last asked); a bar sums the last WINDOW of them.
const WINDOW = 10;
const SEGMENTS = [
  ["execute", "execute"], ["wait_self", "waiting on its own backlog"], ["wait_others", "waiting on others"],
  ["wait_idle", "idle (service overhead)"], ["coalesce", "coalescing window"], ["capture", "capture"],
  ["persist", "persist"], ["page_in", "page-in"],
];

const $ = (id) => document.getElementById(id);
const history = new Map(); // model id -> its recent intervals, newest last
const lastBusy = new Map(); // model id -> its latest interval that ran something
let timer = null;

function reader() {
  let name = sessionStorage.getItem(READER_ITEM);
  if (!name) {
    const bytes = crypto.getRandomValues(new Uint8Array(6));
    name = "console-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    sessionStorage.setItem(READER_ITEM, name);
  }
  return name;
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.append(cell instanceof Node ? cell : element("td", cell));
  return tr;
}

function cell(content, className) {
  const td = element("td", null, className);
  td.append(content instanceof Node ? content : document.createTextNode(content ?? "–"));
  return td;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

function expires(iso) {
  if (!iso) return "never";
  const seconds = (new Date(iso) - Date.now()) / 1000;
  if (seconds <= 0) return "expired";
  const hours = seconds / 3600;
  return hours >= 48 ? `in ${(hours / 24).toFixed(1)} d` : hours >= 1 ? `in ${hours.toFixed(1)} h`
    : `in ${Math.ceil(seconds / 60)} min`;
}

// The bar of one model: its recent intervals summed, or its latest busy one when it ran nothing lately.
function recent(modelId, interval) {
  const kept = history.get(modelId) || [];
  if (interval) {
    kept.push(interval);
    if (interval.commands > 0) lastBusy.set(modelId, interval);
  }
  history.set(modelId, kept.slice(-WINDOW));
  const busy = history.get(modelId).filter((i) => i.commands > 0);
  if (!busy.length) return lastBusy.get(modelId) || null;
  const sum = { seconds: {}, steps: 0, commands: 0, batchTotal: 0 };
  for (const [segment] of SEGMENTS) sum.seconds[segment] = 0;
  for (const i of busy) {
    for (const [segment] of SEGMENTS) sum.seconds[segment] += i.seconds[segment] || 0;
    sum.steps += i.steps;
    sum.commands += i.commands;
    sum.batchTotal += (i.mean_batch || 0) * i.commands;
  }
  sum.mean_batch = sum.commands ? sum.batchTotal / sum.commands : null;
  return sum;
}

function bar(path) {
  const box = element("div", null, "bar");
  if (!path) return box;
  const total = SEGMENTS.reduce((t, [segment]) => t + (path.seconds[segment] || 0), 0);
  for (const [segment, label] of SEGMENTS) {
    const seconds = path.seconds[segment] || 0;
    if (!total || seconds <= 0) continue;
    const seg = element("span", null, `seg seg-${segment}`);
    seg.dataset.segment = segment;
    seg.dataset.seconds = String(seconds);
    seg.style.width = `${(100 * seconds) / total}%`;
    seg.style.background = `var(--${segment})`;
    const perStep = path.steps ? `, ${(seconds / path.steps).toFixed(3)} s per step` : "";
    seg.title = `${label}: ${seconds.toFixed(3)} s (${((100 * seconds) / total).toFixed(0)}%)${perStep}`;
    box.append(seg);
  }
  return box;
}

function drawModels(models) {
  const body = $("models").querySelector("tbody");
  body.replaceChildren();
  const live = new Set();
  for (const model of models) {
    live.add(model.model_id);
    const path = model.state === "loaded" ? recent(model.model_id, model.critical_path) : null;
    const tr = row([
      cell(model.model_id, "id"), cell(model.tenant, "admin-only"), cell(model.state), cell(model.base_model),
      cell(model.rank), cell(model.trainer), cell(model.tier, model.tier ? `tier-${model.tier}` : ""),
      cell(bar(path)), cell(path ? path.steps : "–"),
      cell(path && path.mean_batch ? path.mean_batch.toFixed(2) : "–"),
    ]);
    tr.dataset.modelId = model.model_id;
    body.append(tr);
  }
  for (const id of [...history.keys()]) if (!live.has(id)) { history.delete(id); lastBusy.delete(id); }
}

function drawTrainers(trainers) {
  const box = $("trainers");
  box.replaceChildren();
  if (trainers === null) {
    box.append(element("p", "The trainers did not answer in time; they are starting, stopping or busy.", "muted"));
    return;
  }
  const nodes = new Map();
  for (const trainer of trainers) {
    const node = trainer.node_ip || trainer.node_id || "no node yet";
    if (!nodes.has(node)) nodes.set(node, []);
    nodes.get(node).push(trainer);
  }
  for (const [node, onNode] of nodes) {
    const section = element("div", null, "node");
    section.append(element("h3", `node ${node}`));
    const table = element("table");
    table.append(row(["trainer", "base model", "state", "device", "ranks", "slots", "room (device / host / disk)",
      "models", "yours"].map((h) => element("th", h))));
    for (const t of onNode) {
      const room = t.room ? `${t.room.device} / ${t.room.host} / ${t.room.disk}` : "–";
      const tr = row([cell(t.name, "id"), cell(t.base_model), cell(t.state), cell(t.gpu ? "GPU" : "CPU"),
        cell(t.ranks), cell(t.slots), cell(room), cell(t.models), cell(t.model_ids.join(", ") || "–", "id wrap")]);
      tr.dataset.trainer = t.name;
      table.append(tr);
    }
    section.append(table);
    box.append(section);
  }
}

function drawCheckpoints(checkpoints) {
  const body = $("checkpoints").querySelector("tbody");
  body.replaceChildren(...checkpoints.map((c) => row([
    cell(c.model_id, "id"), cell(c.checkpoint_id, "id"), cell(c.checkpoint_type), cell(bytes(c.size_bytes)),
    cell(expires(c.expires_at)), cell(when(c.time))])));
}

function drawSessions(sessions) {
  const body = $("sessions").querySelector("tbody");
  body.replaceChildren(...sessions.map((s) => row([
    cell(s.session_id, "id"), cell(s.owner, "admin-only"), cell(s.status ? s.status.type : "idle"), cell(s.models),
    cell(`${s.checkpoints_count} (${bytes(s.checkpoint_storage_bytes)})`), cell(when(s.created_at))])));
}

function draw(overview) {
  $("tenant").textContent = overview.tenant;
  $("admin").hidden = !overview.admin;
  document.body.classList.toggle("admin", overview.admin);
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  $("models-count").textContent = `(${overview.models.length} of ${overview.models_total})`;
  $("window-s").textContent = String((WINDOW * REFRESH_MS) / 1000);
  drawModels(overview.models);
  drawTrainers(overview.trainers);
  drawCheckpoints(overview.checkpoints);
  drawSessions(overview.sessions);
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function show(signedIn) {
  $("sign-in").hidden = signedIn;
  $("who").hidden = !signedIn;
  $("console").hidden = !signedIn;
}

async function refresh() {
  const key = sessionStorage.getItem(KEY_ITEM);
  if (!key) return;
  let response;
  try {
    response = await fetch(`/api/v1/console/overview?reader=${encodeURIComponent(reader())}`,
      { headers: { "X-API-Key": key }, cache: "no-store" });
  } catch (error) {
    if (sessionStorage.getItem(KEY_ITEM) !== key) return;
    showError(`The server did not answer (${error.message}); retrying.`);
    return schedule();
  }
  const body = await response.json().catch(() => ({}));
  if (sessionStorage.getItem(KEY_ITEM) !== key) return; // signed out, or in with another key, meanwhile
  if (response.status === 401) {
    signOut();
    showError(body.detail || "That API key was refused.");
    return;
  }
  if (!response.ok) {
    showError(body.detail || `The server answered ${response.status}; retrying.`);
    return schedule();
  }
  showError("");
  show(true);
  draw(body);
  schedule();
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(refresh, REFRESH_MS);
}

function signOut() {
  clearTimeout(timer);
  sessionStorage.removeItem(KEY_ITEM);
  sessionStorage.removeItem(READER_ITEM);
  history.clear();
  lastBusy.clear();
  show(false);
}

document.addEventListener("DOMContentLoaded", () => {
  $("legend").append(...SEGMENTS.map(([segment, label]) => {
    const swatch = element("span", label);
    swatch.style.setProperty("--swatch", `var(--${segment})`);
    return swatch;
  }));
  $("sign-in").addEventListener("submit", (event) => {
    event.preventDefault();
    signOut();
    sessionStorage.setItem(KEY_ITEM, $("api-key").value.trim());
    $("api-key").value = "";
    showError("");
    refresh();
  });
  $("sign-out").addEventListener("click", () => { signOut(); showError(""); });
  show(false);
  refresh();
});
