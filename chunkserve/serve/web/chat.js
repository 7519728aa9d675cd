// The conversation: streamed replies over /v1/chat/completions, a stop button, TTFT and tokens/s.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} sent with each request
let controller = null;  // the reply in flight, aborted by Stop (the server aborts on disconnect)

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const body = {
    messages: history, stream: true, stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value), max_tokens: parseInt($("max-tokens").value, 10),
  };
  controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let first = null, reply = "", tokens = 0, chunks = 0, stopped = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readSSE(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (delta) {
        if (first === null) first = performance.now();
        chunks += 1;
        reply += delta;
        div.textContent = reply;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    });
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else { div.className = "msg error"; div.textContent = reply + (reply ? "\n" : "") + e.message; }
  }
  controller = null;
  setBusy(false);
  history.push({ role: "assistant", content: reply });
  showStats(div, t0, first, tokens || chunks, stopped);
}

function showStats(div, t0, first, tokens, stopped) {
  const stats = document.createElement("span");
  stats.className = "stats";
  const parts = [];
  if (first !== null) {
    parts.push("TTFT " + (first - t0).toFixed(0) + " ms");
    const seconds = (performance.now() - first) / 1000;
    // The first token's time is TTFT's; the rate is over the tokens after it.
    if (tokens > 1 && seconds > 0) parts.push(((tokens - 1) / seconds).toFixed(1) + " tokens/s");
    parts.push(tokens + " tokens");
  }
  if (stopped) parts.push("stopped");
  stats.textContent = parts.join(" · ");
  div.appendChild(stats);
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    $("model").textContent = response.ok ? (await response.json()).data[0].id
      : "(" + (await errorText(response)) + ")";
  } catch (e) { $("model").textContent = ""; }
}

$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem(KEY_STORAGE, $("api-key").value);
  showModel();
  document.dispatchEvent(new Event("apikeychange"));
});
$("send-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("send-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; });
showModel();
