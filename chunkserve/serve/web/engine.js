// The live engine view: the step stream (/engine/steps, one summary per engine per 50 ms at
// most) drawn as a scrolling timeline per engine: its steps, and a lane per request slot.
// The lanes are the server's: it runs the trace timeline's slot rule (engine/lanes.py) over the
// records and sends the spans with their slots; this page only draws what it is sent.
"use strict";

const WINDOW_S = 10;  // seconds of engine time on screen
const LANE_H = 12;    // pixels per request lane
const COLORS = { decode: "#1e88e5", prefill: "#fb8c00", budget: "#e53935", waiting: "#cfd8dc",
                 preempted: "#e53935", "first token": "#0d47a1" };
const view = {
  engines: new Map(),  // engine id -> its timeline (addEngine), one per --data-parallel-size
  preemptions: 0,
};

// ---- one timeline per engine ------------------------------------------------------------------
function newCanvas(className, height) {
  const c = document.createElement("canvas");
  c.className = className; c.width = 760; c.height = height;
  return c;
}

function addEngine(id) {
  const label = document.createElement("h3");
  label.textContent = "engine " + id;
  const box = document.createElement("div");
  box.className = "timeline";
  box.dataset.engine = id;
  const stepsCanvas = newCanvas("steps", 180), lanesCanvas = newCanvas("lanes", 200);
  box.append(label, stepsCanvas, lanesCanvas);
  const after = [...$("timelines").children].find((b) => Number(b.dataset.engine) > id);
  $("timelines").insertBefore(box, after || null);
  const e = { id, label, stepsCanvas, lanesCanvas,
              steps: [],      // step summaries on screen, oldest first
              spans: [],      // closed lane spans on screen: {kind, request_id, slot, start, end}
              instants: [],   // {kind, request_id, slot, at}
              open: [],       // spans open at the engine's latest step: {kind, ..., start}
              slots: 0,       // lanes to draw: the highest slot seen + 1
              clock: null,    // {engine, wall}: the latest step's end, and when it was received
              stats: { kv: 0, waiting: 0, running: 0 } };
  view.engines.set(id, e);
  // One engine looks as it always did; with several, each timeline says whose it is.
  for (const other of view.engines.values()) other.label.hidden = view.engines.size < 2;
  return e;
}

function engineOf(id) {
  return view.engines.get(id) || addEngine(id);
}

// ---- the stream -------------------------------------------------------------------------------
function onSummary(summary) {
  if (summary.hello) return;
  const e = engineOf(summary.engine || 0);
  for (const s of summary.steps) {
    e.steps.push(s);
    view.preemptions += s.preemptions;
  }
  e.spans.push(...summary.spans);
  e.instants.push(...summary.instants);
  e.open = summary.open;
  for (const x of [...summary.spans, ...summary.instants, ...summary.open]) {
    e.slots = Math.max(e.slots, x.slot + 1);
  }
  const last = summary.steps[summary.steps.length - 1];
  e.clock = { engine: last.start + last.duration, wall: performance.now() };
  e.stats = { kv: summary.kv_usage, waiting: summary.waiting, running: summary.running };
  showEngineStats();
}

// The header's figures are the engines' together (KV: their mean, as their pools are equal).
function showEngineStats() {
  const all = [...view.engines.values()].map((e) => e.stats);
  const kv = all.reduce((sum, s) => sum + s.kv, 0) / Math.max(1, all.length);
  $("kv").textContent = (kv * 100).toFixed(2) + "%";
  $("kv-meter").value = kv;
  $("waiting").textContent = all.reduce((sum, s) => sum + s.waiting, 0);
  $("running").textContent = all.reduce((sum, s) => sum + s.running, 0);
  $("preemptions").textContent = view.preemptions;
  for (const e of view.engines.values()) {
    e.label.textContent = `engine ${e.id}: KV ${(e.stats.kv * 100).toFixed(1)}%, ` +
                          `waiting ${e.stats.waiting}, running ${e.stats.running}`;
  }
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
function engineNow(e) {
  return e.clock ? e.clock.engine + (performance.now() - e.clock.wall) / 1000 : 0;
}

// The canvas at its displayed size, so that nothing is drawn stretched (text stays sharp).
function fit(canvas, height) {
  const width = canvas.clientWidth || canvas.width;
  if (canvas.width !== width) canvas.width = width;
  if (canvas.height !== height) canvas.height = height;
  return canvas.getContext("2d");
}

// The step chart's y-axis: the tallest step shown, or the budget where it is at most twice that
// (the line is then in view), plus a tenth. An adaptive cap can be thousands of tokens over the
// steps it allows (9,011 for steps of a few dozen), and scaling to it left every bar a pixel
// high: a budget that far above is drawn at the top edge and named in the corner instead.
function stepScale(steps) {
  let tallest = 1, budget = 0;
  for (const s of steps) {
    tallest = Math.max(tallest, s.prefill_tokens + s.decode_tokens);
    budget = Math.max(budget, s.budget || 0);
  }
  const top = (budget <= 2 * tallest ? Math.max(tallest, budget) : tallest) * 1.1;
  return { top, budget, clipped: budget > top };
}

function drawSteps(e, now) {
  const canvas = e.stepsCanvas, g = fit(canvas, canvas.height);
  const W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  while (e.steps.length && e.steps[0].start + e.steps[0].duration < now - WINDOW_S) e.steps.shift();
  const { top, budget, clipped } = stepScale(e.steps);
  const x = (t) => W - (now - t) / WINDOW_S * W, y = (tokens) => H - Math.min(tokens, top) / top * H;
  for (const s of e.steps) {
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
  if (clipped) { g.fillStyle = COLORS.budget; g.fillText("budget " + budget + " (above)", 4, 26); }
  g.fillText(WINDOW_S + " s ago", 4, H - 4);
  g.fillText("bar width = step duration", W - 140, 12);
}

function drawLanes(e, now) {
  const canvas = e.lanesCanvas, g = fit(canvas, Math.max(8, e.slots) * LANE_H);
  const W = canvas.width;
  g.clearRect(0, 0, W, canvas.height);
  const x = (t) => W - (now - t) / WINDOW_S * W;
  e.spans = e.spans.filter((s) => s.end >= now - WINDOW_S);
  e.instants = e.instants.filter((i) => i.at >= now - WINDOW_S);
  for (const s of [...e.spans, ...e.open]) {  // an open span reaches up to now
    const top = s.slot * LANE_H + 1, x0 = x(s.start), x1 = x(s.end === undefined ? now : s.end);
    // Chunks get the steps' pixel gap, so that back-to-back chunks read as separate steps.
    const w = s.kind === "prefill" && x1 - x0 >= 3 ? x1 - x0 - 1 : Math.max(1, x1 - x0);
    g.fillStyle = COLORS[s.kind];
    if (s.kind === "waiting") g.fillRect(x0, top + 3, w, LANE_H - 8);
    else g.fillRect(x0, top, w, LANE_H - 2);
  }
  for (const i of e.instants) {
    g.fillStyle = COLORS[i.kind];
    g.fillRect(x(i.at) - 1, i.slot * LANE_H, i.kind === "preempted" ? 3 : 2, LANE_H);
  }
}

function draw() {
  let recent = 0;
  for (const e of view.engines.values()) {
    const now = engineNow(e);
    drawSteps(e, now);
    drawLanes(e, now);
    recent += e.steps.filter((s) => s.start > now - 1).length;
  }
  $("step-rate").textContent = recent;
  requestAnimationFrame(draw);
}

engineOf(0);  // drawn empty until the first summary, as a single engine always looks
document.addEventListener("apikeychange", connect);
connect();
requestAnimationFrame(draw);
