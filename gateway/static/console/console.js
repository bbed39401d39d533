// The fleet's web console: plain DOM, no framework, no build step. Everything the server
// sends back is put on the page with textContent, never as HTML.
"use strict";

const KEY_ITEM = "fleet.apiKey";
const BATCHES_ITEM = "fleet.batches";
const TERMINAL = new Set(["succeeded", "failed", "canceled", "expired"]);
const BATCH_DONE = new Set(["completed", "cancelled", "failed", "expired"]);

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fmtSeconds(s) {
  return s === null || s === undefined ? "–" : `${Number(s).toFixed(3)} s`;
}

function storedList(item) {
  try { return JSON.parse(sessionStorage.getItem(item) || "[]"); } catch { return []; }
}

function remember(item, id, max = 50) {
  const ids = storedList(item).filter((x) => x !== id);
  ids.unshift(id);
  sessionStorage.setItem(item, JSON.stringify(ids.slice(0, max)));
}

// ---- API key and requests ---------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code;
    this.detail = err;
  }
}

let keyPrompt = null; // one dialog for all the requests that got a 401 at once

function showKeyLabel() {
  const key = sessionStorage.getItem(KEY_ITEM);
  $("key-label").textContent = key ? `key …${key.slice(-4)}` : "no API key";
}

function askForKey(reason) {
  if (keyPrompt) return keyPrompt;
  keyPrompt = new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason || "This fleet needs an API key.";
    $("key-input").value = "";
    const finish = (key) => {
      dialog.removeEventListener("close", onClose);
      keyPrompt = null;
      if (key) sessionStorage.setItem(KEY_ITEM, key);
      showKeyLabel();
      resolve(key);
    };
    const onClose = () => finish(dialog.returnValue === "save" ? $("key-input").value.trim() : "");
    dialog.addEventListener("close", onClose);
    dialog.returnValue = "";
    dialog.showModal();
    $("key-input").focus();
  });
  return keyPrompt;
}

// fetch() with the bearer key; a 401 asks for a key and tries again with it.
async function api(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const body = await response.json().catch(() => null);
    const given = await askForKey(new ApiError(401, body).message);
    if (!given) throw new ApiError(401, body);
  }
}

async function apiJson(path, options = {}) {
  const response = await api(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

function postJson(path, body) {
  return { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
}

// ---- tabs -------------------------------------------------------------------------------

const tabHooks = {};

function showTab(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  for (const section of document.querySelectorAll("section.tab")) {
    section.classList.toggle("hidden", section.id !== `tab-${name}`);
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  for (const [tab, hook] of Object.entries(tabHooks)) hook(tab === name);
}

// ---- Server-Sent Events over fetch (EventSource cannot POST or send headers) ------------

async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = val;
        else if (field === "data") data.push(val);
      }
      if (data.length) onEvent(event, JSON.parse(data.join("\n")));
    }
  }
}

// ---- Playground -------------------------------------------------------------------------

const play = { jobId: null, running: false };

function playMode() {
  return document.querySelector("input[name=play-mode]:checked").value;
}

function playBody() {
  const text = $("play-prompt").value;
  const body = { stream: true, max_new_tokens: Number($("play-max-tokens").value) };
  const model = $("play-model").value;
  if (model) body.model = model;
  if (playMode() === "chat") {
    const system = $("play-system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: text }];
  } else {
    body.prompt = text;
  }
  body.temperature = Number($("play-temperature").value);
  body.top_p = Number($("play-top-p").value);
  const stop = $("play-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("play-seed").value !== "") body.seed = Number($("play-seed").value);
  return body;
}

function showTimings(target, job) {
  target.replaceChildren();
  const m = job.metrics || {};
  const usage = (job.output && job.output.usage) || {};
  const facts = [
    ["status", job.status],
    ["queue", fmtSeconds(m.queue_seconds)],
    ["inference", fmtSeconds(m.inference_seconds)],
    ["batch size", m.batch_size ?? "–"],
    ["worker", job.worker ?? "–"],
    ["finish reason", (job.output && job.output.finish_reason) ?? "–"],
    ["tokens", usage.completion_tokens !== undefined ? `${usage.prompt_tokens} in, ${usage.completion_tokens} out` : "–"],
  ];
  if (m.cache_hit) facts.push(["cache", "hit"]);
  if (m.coalesced) facts.push(["cache", "coalesced"]);
  for (const [name, value] of facts) {
    target.append(el("dt", name), el("dd", value));
  }
}

async function submitPlayground(event) {
  event.preventDefault();
  if (play.running) return;
  $("play-error").textContent = "";
  $("play-output").textContent = "";
  $("play-timings").replaceChildren();
  $("play-job-id").textContent = "";
  play.jobId = null;
  play.running = true;
  $("play-submit").disabled = true;
  $("play-status").textContent = "submitting…";
  try {
    const response = await api("/v1/jobs", postJson("/v1/jobs", playBody()));
    if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
    const headerId = response.headers.get("Fleet-Job-Id");
    if (headerId) setPlayJob(headerId);
    let final = null;
    await readEvents(response, (name, data) => {
      if (name === "created") {
        setPlayJob(data.id);
        $("play-status").textContent = data.status;
      } else if (name === "token") {
        $("play-status").textContent = "generating…";
        $("play-output").append(document.createTextNode(data.delta));
      } else if (name === "restart") {
        $("play-output").textContent = "";
      } else if (name === "done") {
        final = data;
      }
    });
    if (final) {
      $("play-status").textContent = final.status;
      showTimings($("play-timings"), final);
      if (final.output && final.output.text !== undefined) $("play-output").textContent = final.output.text;
      if (final.error) $("play-error").textContent = `${final.error.code}: ${final.error.message}`;
    } else {
      $("play-status").textContent = "the stream ended early; look the job up in Jobs";
    }
  } catch (err) {
    $("play-error").textContent = err.message;
    $("play-status").textContent = "";
  } finally {
    play.running = false;
    $("play-submit").disabled = false;
    $("play-cancel").disabled = true;
  }
}

function setPlayJob(id) {
  if (play.jobId === id) return;
  play.jobId = id;
  $("play-job-id").textContent = id;
  $("play-cancel").disabled = false;
}

async function cancelPlayground() {
  if (!play.jobId) return;
  $("play-cancel").disabled = true;
  try {
    const job = await apiJson(`/v1/jobs/${encodeURIComponent(play.jobId)}/cancel`, { method: "POST" });
    $("play-status").textContent = job.status === "canceled" ? "canceled" : "cancelling…";
  } catch (err) {
    $("play-error").textContent = err.message;
  }
}

async function loadModels() {
  try {
    const list = await apiJson("/v1/models");
    const select = $("play-model");
    select.replaceChildren();
    for (const model of list.data) {
      const option = el("option", `${model.id} (${model.ready_workers} ready)`);
      option.value = model.id;
      select.append(option);
    }
  } catch (err) {
    $("play-error").textContent = `models: ${err.message}`;
  }
}

// ---- Jobs -------------------------------------------------------------------------------

// Your API key's recent jobs (GET /v1/jobs: newest first), read as the tab opens.
async function renderRecentJobs() {
  const list = $("job-recent");
  let jobs;
  try {
    jobs = (await apiJson("/v1/jobs?limit=20")).data;
  } catch (err) {
    list.replaceChildren(el("li", `recent jobs: ${err.message}`, "error"));
    return;
  }
  list.replaceChildren();
  for (const job of jobs) {
    const item = el("li");
    const link = el("a", job.id);
    link.href = "#jobs";
    link.addEventListener("click", (event) => { event.preventDefault(); $("job-id").value = job.id; lookUpJob(); });
    item.append(link, el("span", ` ${job.status} · ${job.created_at}`, "note"));
    list.append(item);
  }
}

tabHooks.jobs = (visible) => { if (visible) renderRecentJobs(); };

async function lookUpJob(event) {
  if (event) event.preventDefault();
  const id = $("job-id").value.trim();
  if (!id) return;
  $("job-error").textContent = "";
  $("job-detail").classList.add("hidden");
  try {
    const job = await apiJson(`/v1/jobs/${encodeURIComponent(id)}`);
    $("job-title").textContent = job.id;
    const facts = $("job-facts");
    showTimings(facts, job);
    for (const [name, value] of [
      ["model", job.model], ["created", job.created_at], ["started", job.started_at],
      ["completed", job.completed_at], ["batch", job.batch_id], ["custom id", job.custom_id],
    ]) {
      if (value) facts.append(el("dt", name), el("dd", value));
    }
    $("job-input").textContent = JSON.stringify(job.input, null, 2);
    $("job-output").textContent = job.output ? job.output.text : "–";
    $("job-err").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "–";
    $("job-detail").classList.remove("hidden");
    const deliveries = await apiJson(`/v1/jobs/${encodeURIComponent(id)}/webhook_deliveries`);
    renderDeliveries(deliveries.data || []);
  } catch (err) {
    $("job-error").textContent = err.message;
  }
}

function renderDeliveries(deliveries) {
  const body = document.querySelector("#job-deliveries tbody");
  body.replaceChildren();
  if (!deliveries.length) {
    const row = el("tr");
    const cell = el("td", "none");
    cell.colSpan = 4;
    row.append(cell);
    body.append(row);
  }
  for (const d of deliveries) {
    const row = el("tr");
    const attempts = el("td");
    const list = el("ol");
    for (const a of d.attempts || []) {
      const outcome = a.status ?? a.error ?? "no answer";
      const retry = a.next_retry_at ? ` (retry ${a.next_retry_at})` : "";
      list.append(el("li", `#${a.attempt} ${a.at} ${outcome} ${a.duration_ms} ms${retry}`));
    }
    attempts.append(list);
    const state = d.error ? `${d.state}: ${d.error}` : d.state;
    row.append(el("td", d.type), el("td", d.url), el("td", state), attempts);
    body.append(row);
  }
}

// ---- Batches ----------------------------------------------------------------------------

const batchRows = new Map(); // id -> {row, batch}
let batchTimer = null;

async function createBatch(file) {
  $("batch-error").textContent = "";
  $("batch-message").textContent = `uploading ${file.name}…`;
  try {
    const text = await file.text();
    const response = await api("/v1/batches", {
      method: "POST", headers: { "Content-Type": "application/x-ndjson" }, body: text,
    });
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(response.status, body);
    remember(BATCHES_ITEM, body.id, 100);
    $("batch-message").textContent = `created ${body.id} (${body.request_counts.total} requests)`;
    showBatch(body);
    pollBatches();
  } catch (err) {
    $("batch-message").textContent = "";
    const line = err.detail && err.detail.line ? `line ${err.detail.line}: ` : "";
    const message = line && err.message.startsWith(line) ? err.message : line + err.message;
    $("batch-error").textContent = `${file.name} was refused: ${message}`;
  } finally {
    $("batch-file").value = "";
  }
}

function showBatch(batch) {
  let entry = batchRows.get(batch.id);
  if (!entry) {
    const row = el("tr");
    row.dataset.batch = batch.id;
    const cells = {};
    for (const name of ["id", "status", "progress", "counts", "actions"]) {
      cells[name] = el("td", null, `batch-${name}`);
      row.append(cells[name]);
    }
    cells.id.textContent = batch.id;
    const bar = el("div", null, "bar");
    bar.append(el("div", null, "done"), el("div", null, "failed"), el("div", null, "cancelled"));
    cells.progress.append(bar);
    const download = el("button", "Results", "batch-download");
    download.type = "button";
    download.addEventListener("click", () => downloadResults(batch.id));
    const cancel = el("button", "Cancel", "batch-cancel");
    cancel.type = "button";
    cancel.addEventListener("click", () => cancelBatch(batch.id));
    cells.actions.append(download, cancel);
    document.querySelector("#batch-table tbody").prepend(row);
    entry = { row, cells, batch };
    batchRows.set(batch.id, entry);
  }
  entry.batch = batch;
  const c = batch.request_counts;
  entry.cells.status.textContent = batch.status;
  entry.cells.counts.textContent = `${c.completed} completed / ${c.failed} failed / ${c.total} total`;
  const [done, failed, cancelled] = entry.cells.progress.firstChild.children;
  const pct = (n) => `${c.total ? (100 * n) / c.total : 0}%`;
  done.style.width = pct(c.completed);
  failed.style.width = pct(c.failed);
  cancelled.style.width = pct(c.cancelled || 0);
  entry.cells.actions.querySelector(".batch-cancel").disabled = BATCH_DONE.has(batch.status) || batch.status === "cancelling";
}

async function pollBatches() {
  clearTimeout(batchTimer);
  const open = storedList(BATCHES_ITEM).filter((id) => {
    const entry = batchRows.get(id);
    return !entry || !BATCH_DONE.has(entry.batch.status);
  });
  for (const id of open) {
    try {
      showBatch(await apiJson(`/v1/batches/${encodeURIComponent(id)}`));
    } catch (err) {
      if (err.status === 404) {
        sessionStorage.setItem(BATCHES_ITEM, JSON.stringify(storedList(BATCHES_ITEM).filter((x) => x !== id)));
      } else {
        $("batch-error").textContent = err.message;
      }
    }
  }
  const pending = [...batchRows.values()].some((e) => !BATCH_DONE.has(e.batch.status));
  if (pending) batchTimer = setTimeout(pollBatches, 1000);
}

async function downloadResults(id) {
  try {
    const response = await api(`/v1/batches/${encodeURIComponent(id)}/results`);
    if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
    const url = URL.createObjectURL(await response.blob());
    const link = el("a");
    link.href = url;
    link.download = `${id}-results.jsonl`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (err) {
    $("batch-error").textContent = err.message;
  }
}

async function cancelBatch(id) {
  try {
    showBatch(await apiJson(`/v1/batches/${encodeURIComponent(id)}/cancel`, { method: "POST" }));
    pollBatches();
  } catch (err) {
    $("batch-error").textContent = err.message;
  }
}

function setUpDrop() {
  const zone = $("batch-drop");
  zone.addEventListener("dragover", (event) => { event.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    const file = event.dataTransfer.files[0];
    if (file) createBatch(file);
  });
  $("batch-file").addEventListener("change", () => {
    const file = $("batch-file").files[0];
    if (file) createBatch(file);
  });
}

// ---- Fleet ------------------------------------------------------------------------------

const HISTORY_S = 60;
const samples = []; // {t, backlog, throughput, latency}
let fleetTimer = null;
let fleetVisible = false;

function num(value, label, id) {
  const box = el("div", null, "num");
  const big = el("b", value);
  if (id) big.id = id;
  box.append(big, el("span", label));
  return box;
}

async function pollFleet() {
  clearTimeout(fleetTimer);
  try {
    const view = await apiJson("/v1/fleet");
    $("fleet-error").textContent = "";
    renderFleet(view);
  } catch (err) {
    $("fleet-error").textContent = err.message;
  }
  if (fleetVisible) fleetTimer = setTimeout(pollFleet, 1000);
}

function renderFleet(view) {
  const box = $("fleet-models");
  box.replaceChildren();
  let backlog = 0;
  let throughput = 0;
  let latency = null;
  for (const model of view.models) {
    const card = el("div", null, "model-card");
    card.append(el("h2", model.id));
    const nums = el("div", null, "nums");
    nums.append(num(model.ready_workers, "ready workers", "fleet-ready-workers"));
    for (const [lane, b] of Object.entries(model.lanes)) {
      nums.append(
        num(b.waiting, `${lane} waiting`, `fleet-backlog-${lane}`),
        num(b.running, `${lane} running`),
        num(`${b.oldest_waiting_s.toFixed(1)} s`, `oldest ${lane} waiting`),
      );
      backlog += b.waiting;
    }
    const r = model.recent;
    nums.append(
      num(r.jobs_per_second.toFixed(2), "jobs/s (last min)"),
      num(r.latency_p50_s === null ? "–" : `${r.latency_p50_s.toFixed(2)} s`, "latency p50"),
      num(r.latency_p95_s === null ? "–" : `${r.latency_p95_s.toFixed(2)} s`, "latency p95"),
      num(model.dead_letters, "dead letters"),
    );
    throughput += r.jobs_per_second;
    if (r.latency_p50_s !== null) latency = Math.max(latency ?? 0, r.latency_p50_s);
    card.append(nums);
    box.append(card);
  }
  samples.push({ t: view.at, backlog, throughput, latency });
  while (samples.length && samples[0].t < view.at - HISTORY_S) samples.shift();
  drawChart($("chart-backlog"), "backlog", "#2f6fde");
  drawChart($("chart-throughput"), "throughput", "#12805c");
  drawChart($("chart-latency"), "latency", "#b54708");
}

function drawChart(canvas, field, color) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const points = samples.filter((p) => p[field] !== null);
  const max = Math.max(1e-9, ...points.map((p) => p[field]));
  const top = max * 1.15;
  const now = samples.length ? samples[samples.length - 1].t : 0;
  const x = (t) => width - ((now - t) / HISTORY_S) * (width - 30) - 4;
  const y = (v) => height - 14 - (v / top) * (height - 24);
  ctx.strokeStyle = "#eaecf0";
  ctx.beginPath();
  ctx.moveTo(26, y(0));
  ctx.lineTo(width, y(0));
  ctx.stroke();
  ctx.fillStyle = "#667085";
  ctx.font = "10px sans-serif";
  ctx.fillText(max >= 10 ? max.toFixed(0) : max.toPrecision(2), 0, y(max) + 3);
  ctx.fillText("0", 0, y(0) + 3);
  ctx.fillText(`-${HISTORY_S}s`, 26, height - 2);
  if (!points.length) return;
  ctx.strokeStyle = color;
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p[field])) : ctx.moveTo(x(p.t), y(p[field]))));
  ctx.stroke();
}

async function loadWorkers() {
  const body = document.querySelector("#workers-table tbody");
  try {
    const list = await apiJson("/v1/admin/workers");
    $("workers-note").textContent = `${list.data.length} live`;
    body.replaceChildren();
    for (const w of list.data) {
      const row = el("tr");
      row.className = "worker-row";
      const loaded = w.loaded_at ? new Date(Number(w.loaded_at) * 1000).toLocaleTimeString() : "";
      const cells = [w.name, w.model, w.state ?? "", w.tokens_per_s ?? "", w.device ?? "", w.engine ?? "", w.quantization ?? "", loaded];
      for (const v of cells) row.append(el("td", v));
      body.append(row);
    }
  } catch (err) {
    body.replaceChildren();
    $("workers-note").textContent = err.status === 403 ? "workers need an admin key (the counts above need none)" : err.message;
  }
}

async function loadDeadLetters() {
  const body = document.querySelector("#dead-table tbody");
  try {
    const list = await apiJson("/v1/admin/dead_letters");
    $("dead-note").textContent = list.data.length ? "" : "none";
    body.replaceChildren();
    for (const d of list.data) {
      const row = el("tr");
      for (const v of [d.id, d.job, d.lane, d.deliveries, d.at]) row.append(el("td", v));
      const cell = el("td");
      const requeue = el("button", "Re-queue");
      requeue.type = "button";
      requeue.addEventListener("click", async () => {
        requeue.disabled = true;
        try {
          const answer = await apiJson(`/v1/admin/dead_letters/${encodeURIComponent(d.id)}/requeue`, { method: "POST" });
          $("dead-note").textContent = answer.requeued ? `re-queued ${d.job}` : `${d.job} had expired: dropped`;
          loadDeadLetters();
        } catch (err) {
          $("dead-note").textContent = err.message;
          requeue.disabled = false;
        }
      });
      cell.append(requeue);
      row.append(cell);
      body.append(row);
    }
  } catch (err) {
    body.replaceChildren();
    $("dead-note").textContent = err.status === 403 ? "dead letters need an admin key" : err.message;
  }
}

let adminTimer = null;

tabHooks.fleet = (visible) => {
  fleetVisible = visible;
  clearInterval(adminTimer);
  if (!visible) return;
  pollFleet();
  loadWorkers();
  loadDeadLetters();
  adminTimer = setInterval(() => { loadWorkers(); loadDeadLetters(); }, 5000);
};

// ---- start ------------------------------------------------------------------------------

function start() {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
  $("key-change").addEventListener("click", () => askForKey("Use another API key."));
  $("key-dismiss").addEventListener("click", () => $("key-dialog").close(""));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    $("key-dialog").close("save");
  });
  for (const radio of document.querySelectorAll("input[name=play-mode]")) {
    radio.addEventListener("change", () => {
      const chat = playMode() === "chat";
      $("play-system-box").classList.toggle("hidden", !chat);
      $("play-text-label").textContent = chat ? "User message" : "Prompt";
    });
  }
  $("play-form").addEventListener("submit", submitPlayground);
  $("play-cancel").addEventListener("click", cancelPlayground);
  $("job-form").addEventListener("submit", lookUpJob);
  setUpDrop();
  showKeyLabel();
  const tab = location.hash.slice(1);
  showTab(["playground", "jobs", "batches", "fleet"].includes(tab) ? tab : "playground");
  loadModels();
  if (storedList(BATCHES_ITEM).length) pollBatches();
}

start();
