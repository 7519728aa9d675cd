"""The `shared-prefix` dataset: prompts that repeat each other, for prefix caching.

`num_groups` groups, each with a common prefix of `prefix_len` tokens (a system prompt, an
agent's tool descriptions) followed by a unique user message of `suffix_len` tokens. With
`num_turns > 1` every group member is a conversation and each turn resends the whole history:
turn k = prefix + (user 1, reply 1, ..., user k). Replies are synthetic text of the request's
output length (an open-loop benchmark cannot wait for the real reply), so a turn shares with
the previous one everything up to that reply. Requests are ordered turn by turn (all first
turns, then all second turns...), so with ordered arrivals a turn comes after the one before.

Built from token segments: with a tokenizer each segment is exact-length text and the prompt is
the segments joined by newlines (re-encoded, so lengths may differ by a token at a seam);
without one (the simulator) the prompt is the segments' ids concatenated.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from chunkserve.benchlib.workloads import (
    BenchRequest,
    BenchTokenizer,
    _allowed_ids,
    _TokenStream,
    exact_length_prompt,
)

_SIM_VOCAB = 32_000  # token ids for tokenizer-free (simulated) prompts


@dataclass
class SharedPrefixSpec:
    num_groups: int = 4
    prefix_len: int = 1000
    suffix_len: int = 64
    num_turns: int = 1

    def verify(self) -> None:
        if self.num_groups < 1 or self.num_turns < 1:
            raise ValueError("shared-prefix: num_groups and num_turns must be at least 1")
        if self.prefix_len < 0 or self.suffix_len < 1:
            raise ValueError("shared-prefix: prefix_len must be >= 0 and suffix_len >= 1")


def add_shared_prefix_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--shared-prefix-num-groups", type=int, default=4,
                   help="shared-prefix: groups, each with its own common prefix")
    p.add_argument("--shared-prefix-len", type=int, default=1000,
                   help="shared-prefix: tokens of each group's common prefix (system prompt)")
    p.add_argument("--shared-prefix-suffix-len", type=int, default=64,
                   help="shared-prefix: tokens of each unique user message")
    p.add_argument("--shared-prefix-num-turns", type=int, default=1,
                   help="shared-prefix: turns per conversation; each turn resends the history")


def spec_from_args(args: argparse.Namespace) -> SharedPrefixSpec:
    spec = SharedPrefixSpec(args.shared_prefix_num_groups, args.shared_prefix_len,
                            args.shared_prefix_suffix_len, args.shared_prefix_num_turns)
    spec.verify()
    return spec


class _Segments:
    """Makes one segment (exact-length text + ids, or bare ids) from a fresh token stream."""

    def __init__(self, tokenizer: BenchTokenizer | None, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.allowed = _allowed_ids(tokenizer) if tokenizer else np.arange(100, _SIM_VOCAB)
        self.rng = rng

    def make(self, n: int) -> tuple[str, list[int]]:
        stream = _TokenStream(self.allowed, int(self.rng.integers(0, len(self.allowed))))
        if n == 0:
            return "", []
        if self.tokenizer is None:
            return "", stream.take(n)
        return exact_length_prompt(self.tokenizer, stream, n)


def shared_prefix_requests(spec: SharedPrefixSpec, num_prompts: int, seed: int, output_len: int,
                           tokenizer: BenchTokenizer | None = None) -> list[BenchRequest]:
    spec.verify()
    rng = np.random.default_rng(seed)
    seg = _Segments(tokenizer, rng)
    prefixes = [seg.make(spec.prefix_len) for _ in range(spec.num_groups)]
    num_convs = math.ceil(num_prompts / spec.num_turns)
    history: list[list[tuple[str, list[int]]]] = [
        [prefixes[c % spec.num_groups]] for c in range(num_convs)
    ]
    requests: list[BenchRequest] = []
    for _turn in range(spec.num_turns):
        for c in range(num_convs):
            if len(requests) == num_prompts:
                break
            history[c].append(seg.make(spec.suffix_len))  # this turn's user message
            requests.append(_request(history[c], output_len, tokenizer))
            history[c].append(seg.make(output_len))  # the (synthetic) reply
    return requests


def _request(parts: list[tuple[str, list[int]]], output_len: int,
             tokenizer: BenchTokenizer | None) -> BenchRequest:
    if tokenizer is None:
        ids = [t for _, seg_ids in parts for t in seg_ids]
        return BenchRequest("", ids, len(ids), output_len)
    text = "\n".join(t for t, _ in parts if t)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return BenchRequest(text, ids, len(ids), output_len)
