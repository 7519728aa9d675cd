"""The built-in web page and its live step stream (serve/routes/web.py), on one server with an
API key: the page's files are open, the stream and the API need the key."""
from __future__ import annotations

import json
import re
import threading
import time
from importlib import resources

import httpx
import pytest

from server_utils import HTTP_TIMEOUT_S, RemoteServer, assert_error

KEY = "sk-web-123"
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "16"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 5  # several 16-token chunks
WEB_FILES = {"index.html": "text/html", "style.css": "text/css", "sse.js": "text/javascript",
             "chat.js": "text/javascript", "engine.js": "text/javascript"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = RemoteServer(tiny_model_dir, ARGS, api_key=KEY)
    yield s
    s.close()


def test_page_and_its_files_are_served_without_the_key(server):
    r = httpx.get(server.url + "/", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name, media_type in WEB_FILES.items():
        assert f"/web/{name}" in r.text or name == "index.html"
        f = httpx.get(f"{server.url}/web/{name}", timeout=HTTP_TIMEOUT_S)
        assert f.status_code == 200 and f.headers["content-type"].startswith(media_type), name


def test_page_fetches_nothing_from_elsewhere():
    # No CDN, no absolute URL: every src/href/fetch in the shipped files is a path on this server.
    web = resources.files("chunkserve.serve").joinpath("web")
    names = sorted(p.name for p in web.iterdir())
    assert names == sorted(WEB_FILES)  # what ships is what is served
    for name in names:
        text = web.joinpath(name).read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
        assert "@import" not in text and "url(" not in text, name


def test_scripts_share_no_global_name():
    # The page's scripts are classic scripts in one global scope: a function declared in two of
    # them silently replaces the first (engine.js's stats once replaced the chat's).
    web = resources.files("chunkserve.serve").joinpath("web")
    seen: dict[str, str] = {}
    for name in sorted(n for n in WEB_FILES if n.endswith(".js")):
        text = web.joinpath(name).read_text()
        for g in re.findall(r"^(?:async\s+)?(?:function|const|let|var|class)\s+([\w$]+)",
                            text, re.M):
            assert g not in seen, f"{g} is global in both {seen[g]} and {name}"
            seen[g] = name


def test_unknown_files_and_the_stream_need_the_key(server):
    assert_error(httpx.get(server.url + "/web/secret.txt", timeout=HTTP_TIMEOUT_S), 401)
    r = httpx.get(server.url + "/web/secret.txt", headers=server.headers(), timeout=HTTP_TIMEOUT_S)
    assert_error(r, 404, "NotFoundError")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/engine/steps", headers=headers, timeout=HTTP_TIMEOUT_S)
        assert_error(r, 401, "AuthenticationError")


def _summaries(server: RemoteServer, until: threading.Event, out: list) -> None:
    with server.http() as http, http.stream("GET", "/engine/steps") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append((time.monotonic(), json.loads(line[6:])))
            if until.is_set():
                return


def test_stream_yields_decimated_summaries_while_a_request_runs(server):
    got: list = []
    done = threading.Event()
    reader = threading.Thread(target=_summaries, args=(server, done, got), daemon=True)
    reader.start()
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got and "hello" in got[0][1] and "chunks" in got[0][1]["hello"]["events"]
    r = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    time.sleep(0.3)  # the last window's summary
    done.set()
    server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})  # wakes the reader
    reader.join(HTTP_TIMEOUT_S)
    summaries = [s for _, s in got[1:]]
    steps = [step for s in summaries for step in s["steps"]]
    chunks = [c for step in steps for c in step.get("chunks", [])]
    assert len(chunks) >= 4 and all(c[1] <= 16 for c in chunks)  # the prompt, chunked
    assert sum(step["decode_tokens"] for step in steps) >= 23
    assert all(step["budget"] == 16 for step in steps)
    assert {"kv_usage", "waiting", "running"} <= set(summaries[0])
    assert [st["step"] for st in steps] == sorted(st["step"] for st in steps)  # none twice
    # Decimated: ~20 a second at most (counted, not timed: the reader may get two at once).
    elapsed = got[-1][0] - got[1][0]
    assert len(summaries) <= elapsed / 0.05 + 2, (len(summaries), elapsed)
