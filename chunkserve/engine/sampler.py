"""Turn a batch of logits into one sampled token per row, with per-row parameters.

Order of operations (vLLM v1's `Sampler`):
  1. logprobs, when asked, come from the *raw* logits (vLLM's default
     `logprobs_mode="raw_logprobs"`), before any masking or temperature.
  1b. structured outputs: a row with a grammar mask (engine/grammar.py) has every token the
     grammar does not allow next set to -inf, before anything else changes its logits.
  2. min_tokens: while a request has produced fewer than `min_tokens` tokens its
     stop_token_ids are masked to -inf, and so are the EOS ids unless `ignore_eos`.
     This mirrors vLLM, where the mask is `all_stop_token_ids` and EOS is only a
     member of that set when `ignore_eos` is False (with ignore_eos EOS never
     stops a request, so there is nothing to suppress).
  3. logit_bias: each row's bias is added to its tokens' logits.
  4. penalties (vLLM's `apply_penalties`), for rows that set one: repetition_penalty over the
     ids seen in the prompt or the output (a positive logit is divided by it, any other
     multiplied), then frequency_penalty * count and presence_penalty * (count > 0) are
     subtracted, counting the output tokens only. Steps 2-4 change greedy rows too.
  5. greedy rows (temperature ~ 0) take the argmax and ignore top-k/top-p/min-p.
  6. other rows: divide by temperature, then min-p, then top-k and top-p, then
     draw (inverse_cdf: one uniform number a row). min-p runs before top-k/top-p as in vLLM
     (min-p is an "argmax-invariant logits processor" applied before the
     top-k/top-p sampler); the order matters for top-p because top-p sees the
     distribution renormalised after min-p's cut.

Seeded rows take their uniform number from their own generator, so a seeded request
gets the same tokens whatever else shares its batch.

A row that cannot be sampled is that row's failure, never the batch's (SamplerOutput.failed): a
row whose processed logits hold a NaN or +inf, or no finite value at all, or whose probabilities
do not sum to a positive finite number, gets token -1 and a RequestError (a client error when the
model's raw logits for it were sound, so its own parameters did it). Anything that raises while
the batch is sampled is retried row by row with the same uniform numbers, so that only the rows
that raise alone fail and the others get the tokens they would have got anyway. Every step is row-wise, and a batch in
which no row sets logit_bias, a penalty or an unmet min_tokens samples the caller's logits as
they are (no copy).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from itertools import chain

import numpy as np
import torch

from chunkserve.outputs import RequestError
from chunkserve.sampling_params import SamplingParams

log = logging.getLogger("chunkserve.engine")


@dataclass
class SamplingRow:
    """What the runner passes for one row of the logits."""

    params: SamplingParams
    # Per-request generator when params.seed is set, created once per request by
    # the runner; None draws from torch's default generator.
    generator: torch.Generator | None
    num_output_tokens: int  # tokens generated so far, for min_tokens
    eos_token_ids: list[int]
    # The request's own token lists (not copies), read only when params.has_penalties.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Structured outputs: int32 words, bit t set where token t is allowed (engine/grammar.py);
    # every other token, and every logit past the mask's vocabulary, is masked to -inf.
    allowed: Any = None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # -1 for a row in `failed`
    # Per row: (sampled token, logprob) first, then the top-`params.logprobs`
    # (token, logprob) pairs of the raw log-softmax. Rows that did not ask get [].
    # None when no row in the batch asked.
    logprobs: list[list[tuple[int, float]]] | None
    # Seconds spent applying grammar masks (step 1b), for the step trace; 0 without any.
    grammar_time: float = 0.0
    # Row index -> why that row could not be sampled (module docstring); its token is -1.
    failed: dict[int, RequestError] = field(default_factory=dict)


UNSAMPLEABLE = ("no token could be sampled: its sampling parameters (penalties, logit_bias, "
                "min_tokens, temperature, a structured output) left its logits non-finite or "
                "excluded every token")
MODEL_NON_FINITE = "the model's logits for it are not finite"


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        # Drawn first, once a step: a retry row by row below draws with the same numbers.
        uniforms = _uniforms(rows, logits.device)
        try:
            return _sample(logits, rows, uniforms)
        except Exception as e:  # noqa: BLE001 - a row's doing until shown otherwise
            if len(rows) == 1:
                log.exception("sampling failed")
                return _failed_alone(e)
            log.warning("sampling %d rows failed (%r): sampling them one by one", len(rows), e)
        return _sample_row_by_row(logits, rows, uniforms)


def _sample(logits: torch.Tensor, rows: list[SamplingRow], uniforms: torch.Tensor
            ) -> SamplerOutput:
    """The batch at once (the module docstring's steps); unsound rows are in `failed`."""
    raw = logits
    logits, grammar_time = _apply_grammar(logits, rows)
    logits = _apply_row_rules(logits, rows, owned=logits is not raw)
    # One pass finds every unsound row: amax carries a NaN anywhere in a row, +inf, or -inf
    # when nothing in the row is finite.
    sound = torch.isfinite(logits.amax(dim=-1))

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    token_ids = torch.empty(len(rows), dtype=torch.long)
    if greedy:
        # An all-greedy batch is one argmax over the whole tensor.
        picked = logits if not random else logits[greedy]
        token_ids[greedy] = picked.argmax(dim=-1).cpu()
    if random:
        probs = _filtered_probs(logits[random], [rows[i].params for i in random])
        drawn, drawn_ok = inverse_cdf(probs, uniforms[random])
        token_ids[random] = drawn.cpu()
        sound[random] &= drawn_ok
    failed = _row_failures(raw, sound)
    token_ids[list(failed)] = -1
    ids = token_ids.tolist()
    return SamplerOutput(token_ids=ids, logprobs=_gather_logprobs(raw, rows, ids, failed),
                         grammar_time=grammar_time, failed=failed)


def _row_failures(raw: torch.Tensor, sound: torch.Tensor) -> dict[int, RequestError]:
    """The unsound rows' errors: the model's own fault where its raw row is not finite (a
    NaN, an inf), else the request's (its parameters turned sound logits into unsound ones)."""
    bad = (~sound).nonzero().flatten().tolist()
    if not bad:
        return {}
    raw_sound = torch.isfinite(raw[bad].float()).all(dim=-1).tolist()
    return {i: RequestError(UNSAMPLEABLE, client_error=True) if ok
            else RequestError(MODEL_NON_FINITE) for i, ok in zip(bad, raw_sound)}


def _failed_alone(e: Exception) -> SamplerOutput:
    return SamplerOutput([-1], None, failed={0: RequestError(f"sampling failed: {e!r}")})


def _sample_row_by_row(logits: torch.Tensor, rows: list[SamplingRow], uniforms: torch.Tensor
                       ) -> SamplerOutput:
    """Each row alone, so that a row that raises fails by itself; the batch's output shape."""
    ids: list[int] = []
    entries: list[list[tuple[int, float]]] = []
    failed: dict[int, RequestError] = {}
    grammar_time = 0.0
    for i, row in enumerate(rows):
        try:
            one = _sample(logits[i : i + 1], [row], uniforms[i : i + 1])
        except Exception as e:  # noqa: BLE001 - this row's failure alone
            log.exception("sampling request row %d failed", i)
            one = _failed_alone(e)
        ids.append(one.token_ids[0])
        entries.append(one.logprobs[0] if one.logprobs is not None else [])
        grammar_time += one.grammar_time
        if 0 in one.failed:
            failed[i] = one.failed[0]
    asked = any(r.params.logprobs is not None for r in rows)
    return SamplerOutput(ids, entries if asked else None, grammar_time, failed)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 1b-4 of the module docstring: grammar mask, min_tokens mask, logit_bias,
    penalties.

    Returns the caller's tensor itself when no row needs any of them, else a new tensor (the
    first step that changes something copies; the later ones write into that copy).
    """
    processed, _ = _apply_grammar(logits, rows)
    return _apply_row_rules(processed, rows, owned=processed is not logits)


def _apply_row_rules(logits: torch.Tensor, rows: list[SamplingRow],
                     owned: bool) -> torch.Tensor:
    """Steps 2-4: min_tokens mask, logit_bias, penalties; in place only when `owned`."""
    processed = _apply_min_tokens(logits, rows, owned)
    processed = _apply_logit_bias(processed, rows, owned=owned or processed is not logits)
    return _apply_penalties(processed, rows, owned=owned or processed is not logits)


def _apply_grammar(logits: torch.Tensor, rows: list[SamplingRow]
                   ) -> tuple[torch.Tensor, float]:
    """A copy of `logits` with -inf wherever a structured row's grammar forbids the token (the
    caller's tensor when no row has a mask), and the seconds that took (the step trace's
    grammar_mask_time; nothing is timed without a masked row).

    The bits of every row are unpacked by numpy at once and applied by one torch op: an op
    per row costs a thread-pool wake-up each, 7 ms apiece on a 2-core host with a neighbour."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return logits, 0.0
    start = time.perf_counter()
    words = np.stack([np.ascontiguousarray(rows[i].allowed, dtype=np.int32) for i in masked])
    # Inverted before unpacking: a set bit is a forbidden token.
    forbidden_bits = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")
    vocab = logits.shape[1]
    n = min(vocab, forbidden_bits.shape[1])
    forbidden = np.zeros((len(rows), vocab), dtype=bool)
    forbidden[masked, n:] = True  # logits past the mask's vocabulary are never allowed
    forbidden[masked, :n] = forbidden_bits[:, :n]
    # where(), not masked_fill: the same values, a third faster on this CPU at 32 rows.
    out = torch.where(torch.from_numpy(forbidden).to(logits.device), float("-inf"), logits)
    return out, time.perf_counter() - start


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow],
                      owned: bool = False) -> torch.Tensor:
    """Mask EOS/stop ids for rows still below min_tokens; copies only when needed."""
    masked: torch.Tensor | None = logits if owned else None
    for i, row in enumerate(rows):
        p = row.params
        if row.num_output_tokens >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            banned += row.eos_token_ids
        banned = [t for t in banned if 0 <= t < logits.shape[1]]
        if not banned:
            continue
        if masked is None:
            masked = logits.clone()  # never modify the caller's tensor
        masked[i, banned] = float("-inf")
    return logits if masked is None else masked


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
    """Adds each row's logit_bias; writes in place only into a tensor this sampler made."""
    vocab = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            # The Processor refuses ids outside the vocabulary; this guards an engine built
            # without a vocabulary check, where a bad id must not fail the whole step.
            if token < vocab:
                row_ids.append(i)
                token_ids.append(token)
                biases.append(bias)
    if not biases:
        return logits
    out = logits if owned else logits.clone()
    dev = out.device
    index = (torch.tensor(row_ids, device=dev), torch.tensor(token_ids, device=dev))
    out.index_put_(index, torch.tensor(biases, dtype=out.dtype, device=dev), accumulate=True)
    return out


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties on the rows that set one.

    Only those rows are gathered and counted, so a batch without penalties pays nothing and a
    row without them next to one with them keeps its logits bit for bit.
    """
    picked = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not picked:
        return logits
    sub_rows = [rows[i] for i in picked]
    vocab, dev = logits.shape[1], logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)

    sub = logits[picked].float()  # advanced indexing copies: the caller's tensor is untouched
    reps = [r.params.repetition_penalty for r in sub_rows]
    if any(rp != 1.0 for rp in reps):
        # One count over prompt + output: only "seen at all" matters here.
        both = [[*r.prompt_token_ids, *r.output_token_ids] for r in sub_rows]
        seen = _token_counts(both, vocab, dev) > 0
        # Unseen ids get a penalty of 1.0: dividing or multiplying by it is exact.
        penalty = torch.where(seen, column(reps), 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    freq = [r.params.frequency_penalty for r in sub_rows]
    pres = [r.params.presence_penalty for r in sub_rows]
    if any(freq) or any(pres):
        counts = _token_counts([r.output_token_ids for r in sub_rows], vocab, dev)
        sub = sub - column(freq) * counts - column(pres) * (counts > 0)
    if len(picked) == len(rows):
        return sub
    out = logits if owned else logits.clone()
    out[picked] = sub.to(out.dtype)
    return out


def _token_counts(
    token_lists: list[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each id occurs in each row's list.

    One scatter-add over every row's tokens. The flat indices are built on the host and copied
    once (no device sync); ids outside [0, vocab), which only an engine without a vocabulary
    check lets through, land in an extra column that is dropped.
    """
    n = len(token_lists)
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(n), lengths)
    flat = (row_of * (vocab + 1) + ids).to(device)
    counts = torch.zeros(n * (vocab + 1), dtype=torch.float32, device=device)
    counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=device))
    return counts.view(n, vocab + 1)[:, :vocab]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p for the non-greedy rows; returns probabilities.

    Every step is row-wise, so a row's result does not depend on its neighbours.
    """
    n, vocab = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits = logits.float() / temp.unsqueeze(1)

    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    # Only the rows that set top-k or top-p are sorted: a full-vocabulary sort is most of the
    # sampler's time (8 rows of 49,152: 29 ms sorted, 3.7 ms not, on a 2-core Xeon;
    # benchmarks/engine/sampler_rows.py), and one request's top_p must not make every other
    # row of its step pay for it.
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:
        sub = _top_k_top_p(logits[cut], [params[i] for i in cut])
        logits = sub if len(cut) == n else logits.index_copy(0, torch.tensor(cut, device=dev), sub)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p (renormalised after top-k), on rows that set one of them."""
    n, vocab = logits.shape
    dev = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev).expand(n, vocab)
    drop = rank >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # Nucleus: keep the smallest prefix whose mass reaches top_p, i.e. drop a token when the
    # mass strictly before it already reaches top_p. The top token has zero mass before it, so
    # it is always kept.
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row (float64; greedy rows' go unused). Seeded rows take
    theirs from their own generator, so a seeded request draws the same whatever shares its
    batch."""
    u = torch.empty(len(rows), dtype=torch.float64, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None and not r.params.greedy]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:  # drawn where the generator lives, then moved
            u[i] = torch.rand(1, dtype=torch.float64, generator=row.generator,
                              device=row.generator.device).item()
    return u


DRAW_BLOCK = 1024  # tokens whose probabilities inverse_cdf sums as one


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's token: the first whose cumulative probability exceeds u[i] * the row's total
    (u in [0, 1), float64), so a token is drawn with its probability and one of probability 0
    never is; and, per row, whether it could draw at all (its total positive and finite; a row
    that could not gets a token inside the vocabulary all the same, never an index past it).
    Why not torch.multinomial: for one sample it draws an exponential variate for every token
    of the vocabulary (measured 16 ms for 12 rows of 49,152 on a 2-core CPU, 10% of a served
    run's engine time); this draws one number a row and sums (0.3 ms). In two levels, so that
    only block sums and one block are accumulated in float64 (a float32 running sum over a
    whole vocabulary leaves the rarest tokens no room): the block holding u, then the token
    within it."""
    n, vocab = probs.shape
    blocks = -(-vocab // DRAW_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * DRAW_BLOCK - vocab))
    grouped = padded.view(n, blocks, DRAW_BLOCK)
    block_mass = grouped.sum(-1, dtype=torch.float64)
    block_cdf = block_mass.cumsum(-1)
    total = block_cdf[:, -1]
    ok = torch.isfinite(total) & (total > 0)
    # < the total: a block of mass 0 is never found below. A row that cannot draw looks for 0.
    target = torch.where(ok, u * total, 0.0)
    block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).squeeze(1)
    block = block.clamp_(max=blocks - 1)  # only an unsound row's NaN sums find no block
    rows = torch.arange(n, device=probs.device)
    within = target - (block_cdf[rows, block] - block_mass[rows, block])
    cdf = grouped[rows, block].cumsum(-1, dtype=torch.float64)
    # The block's two sums may differ in their last bit: stay below its own total, so that the
    # token found has a probability above 0.
    within = torch.minimum(within, torch.nextafter(cdf[:, -1], torch.zeros_like(within)))
    token = torch.searchsorted(cdf, within.unsqueeze(1), right=True).squeeze(1)
    return (block * DRAW_BLOCK + token).clamp_(max=vocab - 1), ok


def _gather_logprobs(
    raw: torch.Tensor, rows: list[SamplingRow], token_ids: list[int],
    failed: dict[int, RequestError] | None = None,
) -> list[list[tuple[int, float]]] | None:
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return None
    result: list[list[tuple[int, float]]] = [[] for _ in rows]
    asked = [i for i in asked if i not in (failed or {})]  # a failed row has no token
    if not asked:
        return result
    entries = logprob_entries(raw[asked], [token_ids[i] for i in asked],
                              [rows[i].params.logprobs or 0 for i in asked])
    for i, entry in zip(asked, entries):
        result[i] = entry
    return result


def logprob_entries(
    logits: torch.Tensor, token_ids: list[int], top_ks: list[int]
) -> list[list[tuple[int, float]]]:
    """Per row: [(token_ids[row], its logprob), *top-k (id, logprob) pairs, descending], from
    the float32 log-softmax of `logits` (raw logits: vLLM's default `raw_logprobs`). Shared by
    the sampled tokens' logprobs and the prompt logprobs (ModelRunner), so both read alike."""
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).cpu().tolist()
    k = min(max(top_ks, default=0), lp.shape[1])
    top_lp: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k:
        values, indices = lp.topk(k)
        top_lp, top_ids = values.cpu().tolist(), indices.cpu().tolist()
    return [[(t, c), *zip(top_ids[r][:kr], top_lp[r][:kr])]
            for r, (t, c, kr) in enumerate(zip(token_ids, chosen, top_ks))]
