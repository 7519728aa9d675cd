"""The web page in a real headless Chromium, driven by Playwright with the system browser.

Skipped unless both are installed (README: "The web page"): `apt-get install -y chromium` and
`pip install playwright==1.49.0` (its own browser download is not needed). One server, with an
API key that the page is given through its key field, and a 64-token step budget so that a long
prompt is chunked.

`CHUNKSERVE_WEB_SCREENSHOT=path.png` saves the engine view during the mixed load (the README's
picture is taken that way).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")

from server_utils import RemoteServer  # noqa: E402

KEY = "sk-browser-1"
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "64"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens: 5+ chunks
LONG_REPLY = 400  # tokens: seconds of streaming, within the tiny model's 512-token context


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_model_dir, ARGS, api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """The page with the key entered and every request it makes recorded."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.requests = []  # type: ignore[attr-defined]
    page.on("request", lambda r: page.requests.append(r.url))
    page.goto(server.url + "/")
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    _until(page, "() => document.getElementById('engine-status').textContent === 'live'")
    yield page
    context.close()


def _until(page, predicate: str, timeout: float = 30.0) -> None:
    """Polls a JS function from here: Playwright's wait_for_function evals a string in the page
    on each poll, which the page's Content-Security-Policy (no 'unsafe-eval') refuses."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(predicate):
        assert time.monotonic() < deadline, f"not true within {timeout}s: {predicate}"
        time.sleep(0.05)


def _send(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")


def _reply_text(page) -> str:
    return page.evaluate("""() => { const m = document.querySelectorAll('.msg.assistant');
        return m.length ? m[m.length - 1].firstChild?.textContent || '' : ''; }""")


def test_chat_streams_a_reply_and_fetches_only_from_the_server(page, server):
    _send(page, "Tell me a story.", 48)
    page.wait_for_selector(".msg.assistant .stats", timeout=30_000)
    stats = page.text_content(".msg.assistant .stats")
    assert "TTFT" in stats and "tokens/s" in stats and "48 tokens" in stats, stats
    assert _reply_text(page)
    assert page.requests and all(u.startswith(server.url + "/") for u in page.requests), \
        page.requests
    paths = {u[len(server.url):] for u in page.requests}
    assert {"/", "/v1/chat/completions", "/engine/steps", "/web/engine.js"} <= paths


def test_stop_aborts_the_request_and_frees_its_kv(page, server):
    before = server.metrics().get("vllm:request_success_total", finished_reason="abort")
    _send(page, "Tell me a very long story.", LONG_REPLY)
    _until(page, "() => document.querySelector('.msg.assistant:last-child')"
                 "?.textContent.length > 20")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:last-child .stats", timeout=10_000)
    assert "stopped" in page.text_content(".msg.assistant:last-child .stats")
    m = server.wait_for(lambda m: m.idle, timeout=10)
    assert m.get("vllm:request_success_total", finished_reason="abort") == before + 1
    assert m.kv_usage == 0


def test_a_long_prompt_is_chunked_while_a_stream_keeps_decoding(page, server):
    _send(page, "Keep talking.", LONG_REPLY)  # the concurrent stream, in the page's chat
    _until(page, "() => document.querySelector('.msg.assistant:last-child')"
                 "?.textContent.length > 5")
    others = [threading.Thread(target=server.post, args=("/v1/completions", {
        "prompt": f"Story {i}:", "max_tokens": 120, "ignore_eos": True})) for i in range(2)]
    long_prompt = threading.Thread(target=server.post, args=("/v1/completions", {
        "prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True}))
    for t in [*others, long_prompt]:
        t.start()
    long_prompt.join(60)
    time.sleep(0.3)  # the last summaries
    shot = os.environ.get("CHUNKSERVE_WEB_SCREENSHOT")
    if shot:
        page.locator("#engine").screenshot(path=shot)
    # The view's own state: each chunk of the long prompt a step of its own, each with decodes.
    steps = page.evaluate("""() => view.steps.filter((s) => s.chunks && s.chunks.some(
        (c) => c[1] >= 32)).map((s) => [s.step, s.decode_tokens, s.chunks.length])""")
    page.click("#stop")
    for t in others:
        t.join(60)
    assert len(steps) >= 4, steps
    assert len({s[0] for s in steps}) == len(steps)  # separate steps
    assert all(decode >= 1 for _, decode, _ in steps), steps  # the stream kept producing
    server.wait_for(lambda m: m.idle, timeout=10)


def test_lanes_follow_each_request_in_the_lowest_free_slot(page):
    # The events the records will carry with the timeline's fields, fed to the page's own
    # handler: lanes as the trace's timeline export draws them.
    lanes = page.evaluate("""() => {
        const step = (n, extra) => ({step: n, engine: 0, start: 100 + n * 0.01, duration: 0.01,
            prefill_tokens: 0, decode_tokens: 0, budget: 64, preemptions: 0, ...extra});
        const summary = (steps) => ({steps, kv_usage: 0, waiting: 0, running: 0, engine: 0});
        onSummary({hello: {events: ["arrived", "admitted", "chunks", "sampled", "preempted",
                                    "finished"], interval_s: 0.05}});
        onSummary(summary([
            step(0, {arrived: [["t-a", 99.9, 100], ["t-b", 99.95, 50]], admitted: ["t-a"],
                     chunks: [["t-a", 64, 0]]}),
            step(1, {admitted: ["t-b"], chunks: [["t-a", 36, 64], ["t-b", 50, 0]],
                     sampled: ["t-a", "t-b"]}),
            step(2, {finished: ["t-a"]})]));
        onSummary(summary([step(3, {arrived: [["t-c", 100.025, 10]], preempted: ["t-b"],
                                    preemptions: 1})]));
        const lane = (rid) => { const r = view.requests.get(rid);
            return {slot: r.slot, phase: r.phase, done: r.done, spans: r.spans.map((s) => s[0])}; };
        return {a: lane("t-a"), b: lane("t-b"), c: lane("t-c")};
    }""")
    a, b, c = lanes["a"], lanes["b"], lanes["c"]
    assert a["spans"] == ["waiting", "prefill", "prefill", "decode"] and a["done"]
    assert c["slot"] == a["slot"] != b["slot"]  # a's slot, freed at its end, is the lowest
    assert b["spans"] == ["waiting", "prefill", "decode", "preempted"] and b["phase"] == "waiting"
    assert c["phase"] == "waiting" and not c["done"]
