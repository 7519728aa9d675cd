"""`--no-web-ui`: the page, its files and the step stream are 404s; the API is unchanged."""
from __future__ import annotations

import httpx

from server_utils import HTTP_TIMEOUT_S, RemoteServer, assert_error


def test_no_web_ui(tiny_model_dir):
    server = RemoteServer(tiny_model_dir, ["--dtype", "float32", "--max-model-len", "128",
                                           "--no-web-ui"])
    try:
        for path in ("/", "/web/chat.js", "/engine/steps"):
            assert_error(httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S), 404)
        assert httpx.get(server.url + "/v1/models", timeout=HTTP_TIMEOUT_S).status_code == 200
    finally:
        server.close()
