"""The Perfetto timeline (issue 32; engine/timeline.py): it follows the trace-event format, its
request lanes reproduce the engine's own TTFT, chunk counts and preemptions, converting a
JSONL trace gives the events written directly, and bad input is a clear message."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.cli import main
from chunkserve.engine.trace import write_trace

PROMPTS = ["Once upon a time " * 9, "The capital of France is", "Hello there " * 12,
           "def f(x):", "A B C D E F G H I J K L M N O P " * 2, "One two three"]
# Small enough that six requests cannot all keep their KV: some are preempted.
ENGINE = {"max_num_batched_tokens": 32, "num_kv_blocks": 10, "max_model_len": 128,
          "block_size": 16, "enable_prefix_caching": False, "dtype": "float32"}
REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "C": {"name", "ph", "ts", "pid",
            "args"}, "i": {"name", "ph", "ts", "pid", "tid", "s"}, "M": {"name", "ph", "pid",
                                                                        "args"}}


@pytest.fixture(scope="module")
def run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run written directly as a timeline, its records kept to write as JSONL too."""
    out = tmp_path_factory.mktemp("timeline")
    llm = LLM(model=tiny_model_dir, trace_file=str(out / "direct.json"), **ENGINE)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    records, finals = [], {}
    while engine.has_unfinished_requests():
        step = engine.step()
        records.append(step.record)
        finals.update({o.request_id: o for o in step.outputs if o.finished})
    engine.close()
    write_trace(str(out / "steps.jsonl"), records)
    return {"dir": out, "records": records, "finals": finals,
            "events": json.loads((out / "direct.json").read_text())["traceEvents"]}


def test_the_timeline_follows_the_trace_event_format(run: dict[str, Any]) -> None:
    events = run["events"]
    lanes: dict[tuple[int, int], list[dict]] = defaultdict(list)
    named = {(e["pid"], e.get("tid")) for e in events if e["ph"] == "M"}
    for e in events:
        assert REQUIRED[e["ph"]] <= e.keys(), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0  # microseconds
        if e["ph"] == "X":
            assert e["dur"] >= 0
            lanes[(e["pid"], e["tid"])].append(e)
            assert (e["pid"], e["tid"]) in named and (e["pid"], None) in named
    for lane in lanes.values():  # complete events in a lane never overlap
        lane.sort(key=lambda e: e["ts"])
        for a, b in zip(lane, lane[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    counters: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            counters[e["name"]].append(e)
    assert set(counters) == {"waiting", "running", "KV usage (%)", "preemptions (total)"}
    for track in counters.values():
        assert all(a["ts"] <= b["ts"] for a, b in zip(track, track[1:]))
    total = [e["args"]["preemptions (total)"] for e in counters["preemptions (total)"]]
    assert total == sorted(total) and total[-1] > 0  # the run did preempt
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == len(run["records"])
    assert {e["name"] for e in steps} <= {"prefill", "decode", "mixed"}
    # A slot per request at most, and fewer when requests come and go.
    assert len({e["tid"] for e in events if e["pid"] == 2 and e["ph"] == "X"}) <= len(PROMPTS)


def test_request_lanes_reproduce_the_engines_metrics(run: dict[str, Any]) -> None:
    events, finals = run["events"], run["finals"]
    first = {e["args"]["request_id"]: e["args"] for e in events if e["name"] == "first token"}
    assert set(first) == set(finals)
    for rid, out in finals.items():
        # The engine stamps the first token after the model ran; the timeline at the step's end.
        assert first[rid]["ttft_ms"] == pytest.approx(out.metrics.ttft * 1e3, abs=5.0)
    lanes = [e for e in events if e.get("cat") == "request"]
    chunks = Counter(e["args"]["request_id"] for e in lanes if e["name"] == "prefill")
    recorded = Counter(p[0] for r in run["records"] for p in r.prefill_requests)
    assert chunks == recorded
    preempted = Counter(e["args"]["request_id"] for e in lanes if e["name"] == "preempted")
    assert preempted == Counter({rid: o.metrics.num_preemptions for rid, o in finals.items()
                                 if o.metrics.num_preemptions})
    for rid, out in finals.items():  # from arrival (its waiting span) to its last span's end
        spans = [e for e in lanes if e["ph"] == "X" and e["args"]["request_id"] == rid]
        arrival = min(e["ts"] for e in spans if e["name"] == "waiting")
        end = max(e["ts"] + e["dur"] for e in spans)
        assert (end - arrival) / 1e3 == pytest.approx(out.metrics.e2e_latency * 1e3, abs=5.0)
        assert any(e["name"] == "decode" for e in spans)


def test_converting_jsonl_gives_the_events_written_directly(run: dict[str, Any],
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    out: Path = run["dir"]
    assert main(["trace", "convert", str(out / "steps.jsonl"), str(out / "converted.json")]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    converted = json.loads((out / "converted.json").read_text())
    assert converted["traceEvents"] == run["events"]
    assert converted["otherData"]["clock"] == "wall"


def test_bad_input_is_a_clear_message(run: dict[str, Any], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    steps = (run["dir"] / "steps.jsonl").read_text().splitlines()
    truncated = tmp_path / "cut.jsonl"
    truncated.write_text("\n".join(steps[:3]) + "\n" + steps[3][: len(steps[3]) // 2])
    assert main(["trace", "convert", str(truncated), str(tmp_path / "x.json")]) == 2
    assert "cut.jsonl:4: not a step record" in capsys.readouterr().err
    nowhere = tmp_path / "missing-dir" / "x.json"
    assert main(["trace", "convert", str(run["dir"] / "steps.jsonl"), str(nowhere)]) == 2
    assert "cannot write the trace file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--trace-file", "t.json", "--trace-format", "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_diagnose_draws_the_worst_gaps_on_the_timeline(run: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out: Path = run["dir"]
    path = out / "diagnosed.json"
    assert main(["diagnose", str(out / "steps.jsonl"), "--perfetto", str(path)]) == 0
    assert "worst gaps" in capsys.readouterr().err
    events = json.loads(path.read_text())["traceEvents"]
    gaps = [e for e in events if e.get("cat") == "diagnose"]
    on_engine = [e for e in gaps if e["pid"] == 1]
    assert 0 < len(on_engine) <= 20
    assert max(e["args"]["gap_ms"] for e in on_engine) == pytest.approx(
        max(e["dur"] for e in on_engine) / 1e3, abs=1e-3)
    for e in on_engine:
        assert e["name"] == e["args"]["cause"] and e["args"]["parts_ms"]
    decodes = [e for e in events if e.get("cat") == "request" and e["name"] == "decode"]
    for e in gaps:
        if e["pid"] == 2:  # nested inside a decode slice of the request that waited
            assert any(d["tid"] == e["tid"] and d["ts"] <= e["ts"]
                       and e["ts"] + e["dur"] <= d["ts"] + d["dur"] + 1e-3 for d in decodes)
    assert any(e["pid"] == 2 for e in gaps)


def test_a_simulated_sweep_writes_labelled_timelines(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`sim --trace-dir --trace-format perfetto`: a timeline per configuration on the virtual
    clock, labelled simulated; the deterministic simulator's JSONL converts to the same."""
    def sim(fmt: str) -> Path:
        out = tmp_path / fmt
        assert main(["sim", "--hardware", "a100-80gb", "--model", "llama-3-8b",
                     "--dataset-name", "mixed", "--num-prompts", "40", "--request-rate", "4",
                     "--chunk-sizes", "none,512", "--seed", "3", "--out", str(out),
                     "--trace-dir", str(out / "traces"), "--trace-format", fmt]) == 0
        return out / "traces"

    direct = sim("perfetto")
    timeline = json.loads((direct / "steps-512.json").read_text())
    assert timeline["otherData"]["clock"] == "simulated"
    names = {e["args"]["name"] for e in timeline["traceEvents"] if e["name"] == "process_name"}
    assert names == {"engine (simulated clock)", "requests (simulated clock)"}
    assert sum(e["name"] == "first token" for e in timeline["traceEvents"]) == 40
    assert (direct / "steps-none.json").exists()
    lines = sim("jsonl")
    converted = tmp_path / "converted.json"
    assert main(["trace", "convert", str(lines / "steps-512.jsonl"), str(converted),
                 "--simulated"]) == 0
    assert json.loads(converted.read_text()) == timeline
    capsys.readouterr()
