"""What rank 0 broadcasts to the tensor-parallel workers, as typed msgspec messages.

The engine config once, as JSON; then each step: what the workers' runners read of the
scheduler's output (the requests' tokens and sampling parameters, block tables, swaps and
grammar masks) — not the scheduler's own objects. Every rank decodes these exact types, so a
peer of the group (possibly on another node) can send wrong data, never code. An empty frame
tells the workers to stop.
"""
from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np

from chunkserve.config import EngineConfig
from chunkserve.core.request import Request
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
from chunkserve.sampling_params import SamplingParams

STOP_FRAME = b""


class _Checked(SamplingParams):
    """A request's parameters as rank 0 accepted them. Checked once, where the request came in
    (engine/processor.py); a worker takes them as they are, so that it samples exactly the
    rows rank 0 samples, and a row only rank 0 could refuse never stops the group."""

    def _verify(self) -> None:
        pass


class _Request(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: _Checked
    eos_token_ids: list[int]


class _Scheduled(msgspec.Struct, array_like=True):
    request: _Request
    num_new_tokens: int
    start: int
    is_decode: bool
    block_tables: list[list[int]]
    samples: bool


class _Step(msgspec.Struct, array_like=True):
    scheduled: list[_Scheduled]
    finished_req_ids: list[str]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    grammar_bitmask: dict[str, bytes]  # int32 words, raw


_encoder = msgspec.msgpack.Encoder()
_steps = msgspec.msgpack.Decoder(_Step)


def encode_config(config: EngineConfig) -> bytes:
    """The config a worker loads its shard with. Workers never schedule, so the adaptive
    policy's step-time model (a callable, which does not travel) is no concern of theirs."""
    portable = config.portable()
    sc = replace(portable.scheduler_config, chunk_policy="static")
    return msgspec.json.encode(replace(portable, scheduler_config=sc))


def decode_config(frame: bytes) -> EngineConfig:
    return msgspec.json.decode(frame, type=EngineConfig)


def encode_step(out: SchedulerOutput) -> bytes:
    scheduled = [
        _Scheduled(_Request(r.request_id, r.prompt_token_ids, r.output_token_ids,
                            r.sampling_params, r.eos_token_ids),
                   s.num_new_tokens, s.start, s.is_decode, s.block_tables, s.samples)
        for s in out.scheduled for r in (s.request,)]
    masks = {rid: np.ascontiguousarray(m, dtype=np.int32).tobytes()
             for rid, m in out.grammar_bitmask.items()}
    return _encoder.encode(_Step(scheduled, out.finished_req_ids, out.blocks_to_swap_out,
                                 out.blocks_to_swap_in, masks))


def decode_step(frame: bytes) -> SchedulerOutput:
    step = _steps.decode(frame)
    scheduled = []
    for s in step.scheduled:
        r = s.request
        req = Request(r.request_id, r.prompt_token_ids, r.sampling_params, 0.0, r.eos_token_ids)
        req.output_token_ids = r.output_token_ids
        req.all_token_ids = r.prompt_token_ids + r.output_token_ids
        scheduled.append(ScheduledRequest(req, s.num_new_tokens, s.start, s.is_decode,
                                          s.block_tables, s.samples))
    return SchedulerOutput(
        scheduled, finished_req_ids=step.finished_req_ids,
        blocks_to_swap_out=[tuple(b) for b in step.blocks_to_swap_out],  # type: ignore[misc]
        blocks_to_swap_in=[tuple(b) for b in step.blocks_to_swap_in],  # type: ignore[misc]
        grammar_bitmask={rid: np.frombuffer(m, dtype=np.int32)
                         for rid, m in step.grammar_bitmask.items()})
