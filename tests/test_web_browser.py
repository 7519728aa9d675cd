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
    # The view's own state: the long prompt's chunks, drawn from the server's lane spans, each
    # in a step of its own, each step with decodes; the streams decoding on other lanes.
    e = page.evaluate("""() => { const e = view.engines.get(0);
        return {steps: e.steps.map((s) => [s.start, s.step, s.decode_tokens]),
                spans: e.spans.concat(e.open).map((s) => [s.kind, s.request_id, s.slot, s.start,
                                                          (s.args || {}).tokens || 0])}; }""")
    page.click("#stop")
    for t in others:
        t.join(60)
    steps = {start: (step, decode) for start, step, decode in e["steps"]}
    chunks: dict[str, list] = {}
    for kind, rid, slot, start, tokens in e["spans"]:
        if kind == "prefill" and tokens >= 32:
            chunks.setdefault(rid, []).append((slot, steps[start]))
    long_rid, long_chunks = max(chunks.items(), key=lambda kv: len(kv[1]))
    assert len(long_chunks) >= 4, chunks
    assert len({step for _, (step, _) in long_chunks}) == len(long_chunks)  # separate steps
    assert all(decode >= 1 for _, (_, decode) in long_chunks), long_chunks  # streams went on
    assert len({slot for slot, _ in long_chunks}) == 1  # one request, one lane
    decoding = {slot for kind, rid, slot, _, _ in e["spans"]
                if kind == "decode" and rid != long_rid}
    assert decoding and long_chunks[0][0] not in decoding  # the streams, on lanes of their own
    server.wait_for(lambda m: m.idle, timeout=10)


def test_a_data_parallel_stream_draws_a_timeline_per_engine(page):
    # One engine: one timeline, unlabelled, as the page always looked.
    assert page.evaluate("() => [...document.querySelectorAll('.timeline h3')].map("
                         "(h) => h.hidden)") == [True]
    # Summaries from two engines, as `serve --data-parallel-size 2` sends them, fed to the
    # page's own handler: engine 1's request r on slot 2, a chunk then decoding (still open).
    page.evaluate("""() => {
        const summary = (engine, t) => ({engine, kv_usage: 0.1 * (engine + 1), waiting: engine,
            running: 2, steps: [{step: 1, engine, start: t - 0.01, duration: 0.01,
                prefill_tokens: 0, decode_tokens: 2, budget: 64, preemptions: 0}],
            spans: [{kind: "prefill", request_id: "r", slot: 2, start: t - 0.5, end: t - 0.4}],
            instants: [{kind: "first token", request_id: "r", slot: 2, at: t - 0.4}],
            open: [{kind: "decode", request_id: "r", slot: 2, start: t - 0.4}]});
        onSummary(summary(1, 50));
        onSummary(summary(0, 1000));
    }""")
    time.sleep(0.2)  # a few frames drawn
    drawn = page.evaluate("""() => [...document.querySelectorAll('.timeline')].map((box) => {
        const c = box.querySelector('canvas.lanes'), g = c.getContext('2d');
        const e = view.engines.get(Number(box.dataset.engine)), now = engineNow(e);
        const x = (t) => Math.round(c.width - (now - t) / WINDOW_S * c.width);
        const px = (t) => Array.from(g.getImageData(x(t), 2 * LANE_H + 5, 1, 1).data.slice(0, 3));
        const h = box.querySelector('h3');
        return {engine: e.id, label: h.hidden ? null : h.textContent, height: c.height,
                chunk: px(1000 * (e.id === 0) + 50 * (e.id === 1) - 0.45), latest: px(now - 0.05)};
    })""")
    assert [d["engine"] for d in drawn] == [0, 1]
    assert drawn[1]["label"] == "engine 1: KV 20.0%, waiting 1, running 2"
    assert drawn[0]["label"].startswith("engine 0: ")
    for d in drawn:
        assert d["height"] == 8 * 12  # at least 8 lanes; slot 2 needs 3
        assert d["chunk"] == [251, 140, 0], d  # the chunk, orange, on slot 2's lane
        assert d["latest"] == [30, 136, 229], d  # the open decode span reaches "now"
    assert page.text_content("#running") == "4"  # the engines' figures together


def test_the_step_chart_scales_to_the_steps_shown_not_the_budget(page):
    """An adaptive cap of 9,011 tokens over steps of a few dozen: the axis is the tallest step's
    (plus a tenth), and the budget, above it, is named as clipped rather than flattening the
    bars to a pixel (issue 52)."""
    got = page.evaluate("""() => stepScale([
        {prefill_tokens: 20, decode_tokens: 4, budget: 9011},
        {prefill_tokens: 0, decode_tokens: 8, budget: 9011}])""")
    assert got["budget"] == 9011 and got["clipped"] is True
    assert got["top"] == pytest.approx(24 * 1.1)
    inside = page.evaluate("() => stepScale([{prefill_tokens: 50, decode_tokens: 6, budget: 64}])")
    assert inside["clipped"] is False and inside["top"] == pytest.approx(64 * 1.1)
