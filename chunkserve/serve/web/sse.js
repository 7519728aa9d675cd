// What the chat and the engine view share: the API key and reading a server-sent stream.
// Both use fetch, not EventSource: EventSource cannot send the Authorization header.
"use strict";

const KEY_STORAGE = "chunkserve.apiKey";

function apiHeaders(extra = {}) {
  const key = localStorage.getItem(KEY_STORAGE) || "";
  return key ? { ...extra, Authorization: "Bearer " + key } : extra;
}

// Calls onData(text) with each event's data, in order, until the stream ends or is aborted.
async function readSSE(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: "))
        .map((l) => l.slice(6)).join("\n");
      if (data) onData(data);
    }
  }
}

// The error message of a refused request, in OpenAI's {"error": {"message"}} shape or not.
async function errorText(response) {
  const text = await response.text();
  try { return JSON.parse(text).error.message; } catch (e) { return response.status + " " + text; }
}
