"""benchmarks/common/memory_fit.py: a benchmark refuses, before starting an engine, a model that
would not fit in this machine's memory, and says which parts add up to what (issue 54)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository root
from benchmarks.common import memory_fit as mf  # noqa: E402
from benchmarks.engine import decode_scaling as ds  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from chunkserve.model.writers.export import export_dummy

    out = tmp_path_factory.mktemp("gguf") / "tiny"
    export_dummy("tiny-llama", "gguf", str(out), quant="q4_0")
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".gguf")]
    return path


def test_fit_passes_under_and_refuses_over_with_every_part_named():
    parts = {"weights as stored": 3 * mf.GiB, "KV pool": 2 * mf.GiB}
    mf.require_fit("chunkserve on m.gguf", parts, available=6 * mf.GiB)
    with pytest.raises(mf.DoesNotFit) as e:
        mf.require_fit("chunkserve on m.gguf", parts, available=4 * mf.GiB)
    said = e.value.message
    assert "chunkserve on m.gguf needs about 5.0 GiB" in said
    assert "weights as stored 3.0" in said and "KV pool 2.0" in said
    assert "4.0 GiB available (MemAvailable)" in said
    assert isinstance(e.value, SystemExit) and e.value.code == said  # exit 1, no traceback


def test_mem_available_is_this_machines():
    assert 0 < mf.mem_available() < 1 << 50


def test_gguf_size_splits_block_linears_from_the_rest(tiny_gguf):
    from chunkserve.model.loaders.gguf import read_gguf_config

    size = mf.GgufSize.of(tiny_gguf)
    c = read_gguf_config(tiny_gguf)
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * c.intermediate_size
    assert size.linear_params == c.num_hidden_layers * per_layer
    assert size.other_params >= c.vocab_size * h  # the embedding, at least
    assert size.file_bytes == os.path.getsize(tiny_gguf)
    parts = mf.chunkserve_gguf_parts(tiny_gguf, kv_bytes=123)
    assert parts["KV pool"] == 123 and parts["weights as stored"] == size.file_bytes


def test_dense_copy_note_says_when_copies_will_not_all_fit(tiny_gguf, monkeypatch):
    monkeypatch.setattr(mf, "dense_copy_bytes", lambda: 2)
    want = mf.GgufSize.of(tiny_gguf).linear_params * 2
    parts = {"weights": 1000}
    assert "fit" in mf.dense_copy_note(tiny_gguf, parts, available=1000 + want)
    short = mf.dense_copy_note(tiny_gguf, parts, available=1000 + want // 2)
    assert "it keeps those that fit" in short and "slower prefill" in short
    monkeypatch.setattr(mf, "dense_copy_bytes", lambda: 0)  # the AVX2 kernel: no copies at all
    assert mf.dense_copy_note(tiny_gguf, parts, available=0) == ""


def test_decode_scaling_refuses_before_loading(tiny_gguf, monkeypatch):
    monkeypatch.setattr(mf, "mem_available", lambda: 64 << 20)  # 64 MiB left on this machine
    with pytest.raises(SystemExit) as e:
        ds.check_memory(tiny_gguf, (1, 8), 16)
    assert "needs about" in str(e.value.code) and "0.1 GiB available" in str(e.value.code)
