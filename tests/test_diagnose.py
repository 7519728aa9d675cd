"""`chunkserve diagnose` on hand-made step traces whose causes are known, and its bad input."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from chunkserve.cli import main
from chunkserve.diagnose.report import diagnose
from chunkserve.engine.trace import StepRecord, read_trace, write_trace

OVERHEAD, PER_TOKEN, PER_PAIR = 0.010, 0.0001, 2e-8


class Trace:
    """Builds records back to back; a step's duration follows the model above unless given."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.clock = 0.0

    def step(self, decodes: int = 0, prefills: list | None = None, *, running: int | None = None,
             preemptions: int = 0, duration: float | None = None, kv: float = 0.3) -> None:
        prefills = prefills or []
        tokens = decodes + sum(n for _, n, _ in prefills)
        pairs = sum(n * (c + n / 2) for _, n, c in prefills)
        if duration is None:
            duration = OVERHEAD + PER_TOKEN * tokens + PER_PAIR * pairs
        self.records.append(StepRecord(
            step=len(self.records), start=self.clock, duration=duration,
            num_prefill_tokens=tokens - decodes, num_decode_tokens=decodes,
            num_prefill_reqs=len(prefills), num_decode_reqs=decodes,
            num_running=running if running is not None else decodes + len(prefills),
            num_waiting=0, kv_usage=kv, kv_blocks_used=10, internal_fragmentation=0,
            num_preemptions=preemptions, num_swapped_blocks=0, token_budget=2048,
            prefill_requests=[list(p) for p in prefills]))
        self.clock += duration


def decode_steps(t: Trace, n: int, decodes: int = 4, chunk: int = 0) -> None:
    for k in range(n):  # varied token counts, so the fit can tell fixed from per-token cost
        t.step(decodes, [(f"bg{k}", 8 + 5 * (k % 7), 0)] if chunk else None)


def test_head_of_line_prefill_is_named() -> None:
    t = Trace()
    decode_steps(t, 30, chunk=1)
    t.step(0, [("big", 3000, 0)], running=5)  # prefill-first: the decodes wait a whole step
    decode_steps(t, 30, chunk=1)
    d = diagnose(t.records, prompt_lens={"big": 3000})
    m = d["max"]
    assert m["cause"] == "long_prefill"
    assert m["culprit"]["request_id"] == "big" and m["culprit"]["prompt_len"] == 3000
    assert m["gap_ms"] == pytest.approx((t.records[30].duration + t.records[31].duration) * 1e3)
    assert m["share"] > 0.9
    assert "--max-num-batched-tokens" in m["flag"] and "--chunk-policy adaptive" in m["flag"]


def test_small_steps_report_fixed_overhead() -> None:
    t = Trace()
    for k in range(60):  # chunk 32 of a long prompt under decode-first, 1-6 decodes each
        t.step(1 + k % 6, [("long", 32, 32 * k)])
    d = diagnose(t.records)
    assert d["fit"]["overhead_ms"] == pytest.approx(OVERHEAD * 1e3, rel=1e-3)
    assert d["max"]["cause"] == "fixed_overhead"
    assert d["p99"]["cause"] == "fixed_overhead"
    busy = sum(r.duration for r in t.records)
    assert d["fixed_overhead_share"] == pytest.approx(60 * OVERHEAD / busy, rel=1e-3)
    assert "larger --max-num-batched-tokens (now 2048)" in d["max"]["flag"]


def test_late_chunks_of_a_long_prompt_blame_attention() -> None:
    t = Trace()
    decode_steps(t, 10, chunk=1)
    for k in range(40):  # 256-token chunks over a growing context, mixed with 4 decodes
        t.step(4, [("doc", 256, 256 * k)])
    d = diagnose(t.records)
    assert d["max"]["cause"] == "attention_growth"
    c = d["max"]["culprit"]
    assert c["request_id"] == "doc" and c["cached"] == 256 * 39


def _preempted(wait_steps: int) -> Trace:
    t = Trace()
    t.step(0, [("v", 100, 0), ("w", 50, 0)])
    decode_steps(t, 10, decodes=2)
    t.step(1, running=1, preemptions=1, kv=0.99)  # v loses its KV
    decode_steps(t, wait_steps, decodes=1)
    t.step(1, [("v", 1500, 0)], running=2)  # recompute (long: v had decoded far by then)
    decode_steps(t, 10, decodes=2)
    return t


def test_preemption_recompute_and_queueing() -> None:
    d = diagnose(_preempted(wait_steps=1).records)
    assert d["num_preemptions"] == 1
    assert d["max"]["cause"] == "preemption_recompute"
    assert d["max"]["culprit"]["request_ids"] == ["v"]
    d = diagnose(_preempted(wait_steps=300).records)
    assert d["max"]["cause"] == "queueing"
    assert d["max"]["culprit"]["kv_usage"] == pytest.approx(0.99)
    assert "--kv-cache-memory" in d["max"]["flag"]


def test_idle_engine_and_lone_prefill_start_no_gap() -> None:
    t = Trace()
    decode_steps(t, 5, decodes=1)
    t.clock += 30.0  # idle: nobody running
    for k in range(50):  # a lone long prompt, chunked: nobody decodes meanwhile
        t.step(0, [("solo", 32, 32 * k)])
    decode_steps(t, 5, decodes=1)
    assert diagnose(t.records)["gaps"]["max_ms"] < 100


def test_cli_text_json_plot_and_requests(tmp_path, capsys) -> None:
    t = Trace()
    decode_steps(t, 20, chunk=1)
    t.step(0, [("r3", 2500, 0)], running=5)
    decode_steps(t, 20, chunk=1)
    path = tmp_path / "steps.jsonl.gz"
    write_trace(str(path), t.records)
    assert read_trace(str(path)) == t.records
    reqs = tmp_path / "reqs.json"
    reqs.write_text(json.dumps({"input_lens": [1, 2, 3, 2500]}))  # bench serve --save-detailed
    png = tmp_path / "t.png"
    assert main(["diagnose", str(path), "--requests", str(reqs), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "prefill in the gap (head-of-line)" in text and "request r3, prompt 2,500 tokens" in text
    assert png.stat().st_size > 10_000
    assert main(["diagnose", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max"]["culprit"]["request_id"] == "r3"


def test_old_traces_without_new_fields_still_load(tmp_path) -> None:
    t = Trace()
    decode_steps(t, 20, chunk=1)
    path = tmp_path / "old.jsonl"
    with open(path, "w") as f:
        for r in t.records:
            row = asdict(r)
            del row["token_budget"], row["prefill_requests"]
            f.write(json.dumps(row) + "\n")
    assert main(["diagnose", str(path)]) == 0


@pytest.mark.parametrize("content, message", [
    ("", "empty trace"),
    ("\n\n", "empty trace"),
    ('{"step": 0}\n', "t.jsonl:1: not a step record"),
    ("not json\n", "t.jsonl:1: not a step record"),
    ("[1, 2]\n", "t.jsonl:1: not a step record"),
])
def test_bad_trace_is_a_clear_error(tmp_path, capsys, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    assert main(["diagnose", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_trace_without_decodes_or_file(tmp_path, capsys) -> None:
    t = Trace()
    t.step(0, [("a", 100, 0)])
    path = tmp_path / "p.jsonl"
    write_trace(str(path), t.records)
    assert main(["diagnose", str(path)]) == 2
    assert "no decode steps" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["diagnose", str(tmp_path)]) == 2  # a directory
