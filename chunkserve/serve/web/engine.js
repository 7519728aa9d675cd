// The live engine view: the step stream (/engine/steps, one summary per 50 ms at most) drawn as
// a scrolling timeline of steps and a lane per request slot, as the trace's timeline shows them.
"use strict";

const WINDOW_S = 10;  // seconds of engine time on screen
const LANE_H = 12;    // pixels per request lane
const COLORS = { decode: "#1e88e5", prefill: "#fb8c00", budget: "#e53935", waiting: "#cfd8dc",
                 preempted: "#e53935" };
const view = {
  steps: [],              // step summaries on screen, oldest first
  requests: new Map(),    // request id -> {slot, spans, phase, since, sampled, done}
  slots: [],              // slot -> request id, or null when free
  clock: null,            // {engine, wall}: the latest step's end, and when it was received
  preemptions: 0,
};

// ---- requests: the lanes ----------------------------------------------------------------------
// A request holds the lowest free slot from its arrival to its end (the timeline export's rule).
function request(rid, at) {
  let r = view.requests.get(rid);
  if (!r) {
    let slot = view.slots.indexOf(null);
    if (slot < 0) { slot = view.slots.length; view.slots.push(null); }
    view.slots[slot] = rid;
    r = { slot, spans: [], phase: "running", since: at, sampled: false, done: false };
    view.requests.set(rid, r);
  }
  return r;
}

function phase(r, name, at) {  // ends the open span (waiting or decode) and opens `name`
  if (r.phase !== "running" && at > r.since) r.spans.push([r.phase, r.since, at]);
  r.phase = name; r.since = at;
}

function release(r, at) {
  phase(r, "running", at);
  r.done = true;
  view.slots[r.slot] = null;
}

function applyEvents(s) {
  const start = s.start, end = s.start + s.duration;
  for (const [rid, arrival] of s.arrived || []) phase(request(rid, arrival), "waiting", arrival);
  for (const rid of s.preempted || []) {
    const r = view.requests.get(rid);
    if (r) { phase(r, "waiting", start); r.spans.push(["preempted", start, start]); }
  }
  for (const rid of s.admitted || []) {
    const r = view.requests.get(rid);
    if (r && r.phase === "waiting") phase(r, "running", start);
  }
  const chunked = new Set();
  for (const [rid] of s.chunks || []) {
    const r = request(rid, start);
    chunked.add(rid);
    phase(r, "running", start);
    r.spans.push(["prefill", start, end]);
  }
  for (const rid of s.admitted || []) {  // swapped back in after its first token: decodes at once
    const r = view.requests.get(rid);
    if (r && !chunked.has(rid) && r.sampled) phase(r, "decode", start);
  }
  for (const rid of s.sampled || []) {
    const r = view.requests.get(rid);
    if (r) { r.sampled = true; phase(r, "decode", end); }
  }
  for (const rid of s.finished || []) {
    const r = view.requests.get(rid);
    if (r && !r.done) release(r, end);
  }
}

// ---- the stream -------------------------------------------------------------------------------
function onSummary(summary) {
  if (summary.hello) return;
  for (const s of summary.steps) {
    view.steps.push(s);
    applyEvents(s);
    view.preemptions += s.preemptions;
  }
  const last = summary.steps[summary.steps.length - 1];
  view.clock = { engine: last.start + last.duration, wall: performance.now() };
  $("kv").textContent = (summary.kv_usage * 100).toFixed(2) + "%";
  $("kv-meter").value = summary.kv_usage;
  $("waiting").textContent = summary.waiting;
  $("running").textContent = summary.running;
  $("preemptions").textContent = view.preemptions;
}

let streamController = null;

async function connect() {
  if (streamController) streamController.abort();
  const controller = streamController = new AbortController();
  let retry = 1000;
  try {
    const response = await fetch("/engine/steps", { headers: apiHeaders(), signal: controller.signal });
    if (!response.ok) {
      $("engine-status").textContent = await errorText(response);
      retry = 5000;
    } else {
      $("engine-status").textContent = "live";
      await readSSE(response, (data) => onSummary(JSON.parse(data)));
      $("engine-status").textContent = "stream ended";
    }
  } catch (e) {
    if (e.name === "AbortError") return;
    $("engine-status").textContent = "disconnected";
  }
  if (streamController === controller) setTimeout(connect, retry);
}

// ---- drawing ----------------------------------------------------------------------------------
function engineNow() {
  return view.clock ? view.clock.engine + (performance.now() - view.clock.wall) / 1000 : 0;
}

// The canvas at its displayed size, so that nothing is drawn stretched (text stays sharp).
function fit(canvas, height) {
  const width = canvas.clientWidth || canvas.width;
  if (canvas.width !== width) canvas.width = width;
  if (canvas.height !== height) canvas.height = height;
  return canvas.getContext("2d");
}

function drawSteps(now) {
  const canvas = $("steps-canvas"), g = fit(canvas, canvas.height);
  const W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  while (view.steps.length && view.steps[0].start + view.steps[0].duration < now - WINDOW_S) view.steps.shift();
  let top = 1;
  for (const s of view.steps) top = Math.max(top, s.budget || 0, s.prefill_tokens + s.decode_tokens);
  top *= 1.1;
  const x = (t) => W - (now - t) / WINDOW_S * W, y = (tokens) => H - tokens / top * H;
  for (const s of view.steps) {
    // A pixel's gap between wide bars, so that back-to-back steps read as separate steps.
    const x0 = x(s.start), full = s.duration / WINDOW_S * W, w = full >= 3 ? full - 1 : Math.max(1, full);
    g.fillStyle = COLORS.decode;
    g.fillRect(x0, y(s.decode_tokens), w, H - y(s.decode_tokens));
    g.fillStyle = COLORS.prefill;
    g.fillRect(x0, y(s.decode_tokens + s.prefill_tokens), w, y(s.decode_tokens) - y(s.decode_tokens + s.prefill_tokens));
    if (s.budget) { g.fillStyle = COLORS.budget; g.fillRect(x0, y(s.budget), Math.max(w, 2), 2); }
  }
  g.fillStyle = "#555";
  g.fillText(Math.round(top) + " tokens", 4, 12);
  g.fillText(WINDOW_S + " s ago", 4, H - 4);
  g.fillText("bar width = step duration", W - 140, 12);
  const recent = view.steps.filter((s) => s.start > now - 1).length;
  $("step-rate").textContent = recent;
}

function drawLanes(now) {
  const canvas = $("lanes-canvas");
  const g = fit(canvas, Math.max(8, view.slots.length) * LANE_H), height = canvas.height;
  const W = canvas.width;
  g.clearRect(0, 0, W, height);
  const x = (t) => W - (now - t) / WINDOW_S * W;
  for (const [rid, r] of view.requests) {
    const open = r.phase !== "running" && !r.done ? [[r.phase, r.since, now]] : [];
    const spans = r.spans.concat(open);
    if (r.done && spans.every(([, , end]) => end < now - WINDOW_S)) { view.requests.delete(rid); continue; }
    const top = r.slot * LANE_H + 1;
    for (const [name, start, end] of spans) {
      g.fillStyle = COLORS[name];
      if (name === "preempted") g.fillRect(x(start) - 1, top - 1, 3, LANE_H);
      else g.fillRect(x(start), top + (name === "waiting" ? 3 : 0), Math.max(1, x(end) - x(start)),
                      name === "waiting" ? LANE_H - 8 : LANE_H - 2);
    }
  }
}

function draw() {
  const now = engineNow();
  drawSteps(now);
  drawLanes(now);
  requestAnimationFrame(draw);
}

document.addEventListener("apikeychange", connect);
connect();
requestAnimationFrame(draw);
