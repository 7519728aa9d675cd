"""Prefix caching through the server: usage.prompt_tokens_details.cached_tokens, the
vllm:prefix_cache_* counters, POST /reset_prefix_cache, and the --[no-]enable-prefix-caching
flag. A real `chunkserve serve` subprocess with the tiny random Llama."""
from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from server_utils import RemoteServer

from chunkserve.engine.arg_utils import add_engine_args, config_from_args

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32",
        "--served-model-name", "tiny", "--enable-dev-endpoints"]
# ~100 tokens: several full blocks of 16, so a resend hits most of it.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 10
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_model_dir, ARGS)
    yield s
    s.close()


def test_flag_defaults_on_and_can_be_turned_off() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).cache_config.enable_prefix_caching is True
    off = p.parse_args(["--no-enable-prefix-caching"])
    assert config_from_args(off).cache_config.enable_prefix_caching is False


def test_cached_tokens_metrics_and_reset(server: RemoteServer) -> None:
    client = server.client()
    m0 = server.metrics()
    assert m0.get("vllm:prefix_cache_queries_total") == 0
    assert m0.get("vllm:prefix_cache_hits_total") == 0

    def complete(**kwargs: object):  # type: ignore[no-untyped-def]
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                          extra_body=IGNORE_EOS, **kwargs)

    first = complete().usage
    assert first.prompt_tokens_details.cached_tokens == 0
    second = complete().usage
    cached = second.prompt_tokens_details.cached_tokens
    # Whole blocks only, and never the whole prompt (the last token is always computed).
    assert cached > 0 and cached % 16 == 0 and cached < second.prompt_tokens
    chunks = list(complete(stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    m = server.wait_idle()
    assert m.get("vllm:prefix_cache_queries_total") == 3 * first.prompt_tokens
    assert m.get("vllm:prefix_cache_hits_total") == 2 * cached

    r = server.http().post("/reset_prefix_cache")
    assert r.status_code == 200
    assert complete().usage.prompt_tokens_details.cached_tokens == 0

    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi"}]
    chats = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                            extra_body=IGNORE_EOS).usage for _ in range(2)]
    assert chats[0].prompt_tokens_details.cached_tokens == 0
    assert chats[1].prompt_tokens_details.cached_tokens > 0
