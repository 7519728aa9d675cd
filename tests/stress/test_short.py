"""The stress suite's short form, inside `make test`: a sample of the fuzz (twice, with the RSS
bound) and schemathesis,
a small disconnect storm, an overload burst and SIGTERM with streams in flight, against the
tiny random-weight preset on loopback (seconds, not minutes; `make stress` runs it all)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from stress.fuzz import run_schemathesis
from stress.memory import run_fuzz_memory
from stress.fuzz_cases import short_cases
from stress.overload import run_overload
from stress.report import PhaseResult, render_table
from stress.shutdown import run_shutdown
from stress.storm import run_storm
from stress.target import Target, server_args

MODEL = "tiny-llama"
MAX_LEN = 256
CAP = 2  # --max-waiting-requests
SEQS = 2  # --max-num-seqs
GRACE_S = 2.0


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target(MODEL, server_args(MODEL, MAX_LEN, CAP, SEQS, GRACE_S), CAP)
    yield t
    problems = t.log_problems()
    t.close()
    assert not problems, problems


def check(result: PhaseResult, target: Target | None) -> None:
    if target is not None:
        result.idle = target.wait_idle()
    assert not result.all_violations(), render_table([result], result.all_violations())


def test_fuzz_sample_twice_gets_no_5xx_no_resets_and_no_rss_growth(target: Target) -> None:
    # Two passes: the second may not grow RSS by more than 5 MiB (stress/memory.py).
    result = run_fuzz_memory(target, short_cases(150))
    check(result, target)
    assert result.requests == 300 and result.statuses[400] > 100


def test_schemathesis_sample(target: Target) -> None:
    result = run_schemathesis(target, examples=3)
    check(result, target)
    assert result.requests > 20


def test_disconnect_storm_frees_everything(target: Target) -> None:
    check(run_storm(target, clients=12, concurrency=CAP + SEQS, max_tokens=MAX_LEN - 16), target)


def test_overload_burst_admits_exactly_the_cap(target: Target) -> None:
    result = run_overload(target, factor=5, max_tokens=8, num_slots=SEQS, filler_tokens=120)
    check(result, target)
    assert result.statuses[503] == 5 * CAP - CAP


def test_sigterm_ends_every_stream_and_exits_in_time() -> None:
    fresh = Target(MODEL, server_args(MODEL, 2048, CAP, 4, GRACE_S), CAP)
    try:
        result = run_shutdown(fresh, GRACE_S, num_long=3, max_model_len=2048)
        problems = fresh.log_problems()
    finally:
        fresh.close()
    check(result, None)
    assert not problems, problems
