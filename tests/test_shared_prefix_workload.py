"""The shared-prefix dataset, and the simulator charging only uncached tokens."""
from __future__ import annotations

import pytest

from chunkserve.benchlib.shared_prefix import SharedPrefixSpec, shared_prefix_requests
from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.sim.cost_model import LinearCostModel
from chunkserve.sim.simulator import SimConfig, simulate


def test_groups_share_their_prefix_and_differ_after_it() -> None:
    spec = SharedPrefixSpec(num_groups=2, prefix_len=40, suffix_len=8)
    reqs = shared_prefix_requests(spec, 6, seed=0, output_len=5)
    assert [r.prompt_len for r in reqs] == [48] * 6
    a, b, c = reqs[0].prompt_token_ids, reqs[1].prompt_token_ids, reqs[2].prompt_token_ids
    assert a[:40] == c[:40] and a[40:] != c[40:]  # same group (0 and 2), own suffixes
    assert a[:40] != b[:40]  # another group


def test_turns_resend_the_history_turn_by_turn() -> None:
    spec = SharedPrefixSpec(num_groups=1, prefix_len=16, suffix_len=4, num_turns=3)
    reqs = shared_prefix_requests(spec, 6, seed=1, output_len=5)  # 2 conversations x 3 turns
    # Turn-major order: conversation 0's turns are requests 0, 2, 4.
    t1, t2, t3 = (reqs[i].prompt_token_ids for i in (0, 2, 4))
    assert len(t1) == 20 and len(t2) == 20 + 5 + 4 and len(t3) == len(t2) + 5 + 4
    assert t2[:20] == t1 and t3[: len(t2)] == t2
    assert reqs[1].prompt_token_ids[:16] == t1[:16]  # the shared system prompt


def test_same_seed_same_workload() -> None:
    spec = SharedPrefixSpec(num_groups=3, prefix_len=10, suffix_len=3, num_turns=2)
    ids = [r.prompt_token_ids for r in shared_prefix_requests(spec, 7, 5, 4)]
    assert ids == [r.prompt_token_ids for r in shared_prefix_requests(spec, 7, 5, 4)]
    with pytest.raises(ValueError):
        shared_prefix_requests(SharedPrefixSpec(num_groups=0), 1, 0, 1)


def _cost() -> LinearCostModel:
    # Time grows with every computed token: a cached token must then save time.
    return LinearCostModel({"step": 1e-3, "token": 1e-4})


def test_simulator_charges_only_uncached_tokens() -> None:
    spec = SharedPrefixSpec(num_groups=1, prefix_len=512, suffix_len=16, num_turns=2)
    reqs = shared_prefix_requests(spec, 8, seed=0, output_len=8)
    arrivals = [float(i) for i in range(len(reqs))]  # one at a time: earlier ones are cached
    point = SweepPoint(256, "decode-first")
    runs = {
        caching: simulate(point, SimConfig(max_model_len=2048, num_kv_blocks=1024,
                                           enable_prefix_caching=caching), _cost(), reqs, arrivals)
        for caching in (True, False)
    }
    prefill = {k: sum(r.num_prefill_tokens for r in run.records) for k, run in runs.items()}
    hits = sum(r.prefix_cache_hits for r in runs[True].records)
    assert hits > 0 and prefill[True] == prefill[False] - hits
    busy = {k: sum(r.duration for r in run.records) for k, run in runs.items()}
    assert busy[True] < busy[False]


def test_lengths_only_workloads_never_hit() -> None:
    """Without token ids the simulator's prompts are unique: no accidental sharing."""
    reqs = length_requests([64] * 6, [4] * 6)
    run = simulate(SweepPoint(128, "decode-first"), SimConfig(max_model_len=256, num_kv_blocks=256),
                   _cost(), reqs, [0.0] * 6)
    assert sum(r.prefix_cache_hits for r in run.records) == 0
