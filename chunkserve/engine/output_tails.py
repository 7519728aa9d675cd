"""What of each request's output crosses from an engine process to the API server: only what the
server has not seen yet, with every token id of a step in one raw frame (issue 52).

A `RequestOutput` is cumulative: each step's output of a request repeats its whole prompt, every
output token so far, their logprobs and timestamps. Sent as it is, a step of 32 requests with
3k-token prompts is ~400 KiB of msgpack and ~3.5 ms to decode in the server, every step. So
the engine side (`OutputSender`) trims each list to the tail its receiver lacks and packs the
token ids (prompt ids once, then each step's new output ids) into one int32 buffer sent as its
own ZeroMQ frame; the server side (`OutputReceiver`) prepends what it holds and hands the front
end the same cumulative outputs the in-process engine gives. Logprobs and timestamps go as
tails inside the message: after trimming they are a step's worth, a few numbers a request.

The rule both sides share: a list only grows at its end (tokens, their logprobs and times are
appended, never rewritten), so a tail is "from index `start` on"; a list that did shrink is
sent whole from 0. The text is compared with what was sent (a stop string cuts its end), and
its tail is sent the same way. Each side forgets a request once it finished, failed or was aborted.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import msgspec

from chunkserve.engine.engine_loop import LoopEvent
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

_IDS = "i"  # int32: every vocabulary fits


class Tail(msgspec.Struct, array_like=True, frozen=True):
    """Where each trimmed list of one output resumes, and its ids' place in the ids frame."""

    num_prompt_ids: int  # > 0 only on a request's first output: its prompt ids lead its ids
    ids_start: int  # the output token ids in the frame continue the receiver's from here
    num_ids: int
    logprobs_start: int
    times_start: int
    prompt_logprobs_start: int
    text_start: int


@dataclass
class _Sent:
    """How much of each list of one request the receiver holds."""

    prompt: bool = False
    ids: int = 0
    logprobs: int = 0
    times: int = 0
    prompt_logprobs: int = 0
    text: str = ""  # the text as sent: a stop string can cut its end, so it is compared


@dataclass
class _Held:
    """One request's lists as the receiver has them (each output gets new lists built from
    these, so an output already handed on never changes under its reader)."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] | None = None
    times: list[float] = field(default_factory=list)
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    text: str = ""


def _start(sent: int, length: int) -> int:
    return sent if length >= sent else 0  # shrunk (never expected): send it whole


def _join(held: list | None, start: int, tail: list | None) -> list | None:
    if tail is None:
        return None
    return tail if start == 0 or held is None else held[:start] + tail


def _forget_ended(table: dict, ev: LoopEvent) -> None:
    for rid, out, _ in ev.outputs:
        if out.finished:
            table.pop(rid, None)
    for rid, _ in ev.errors:
        table.pop(rid, None)
    for rid in ev.aborted:
        table.pop(rid, None)
    if ev.fatal is not None:
        table.clear()


class OutputSender:
    """The engine process's side: trims an event's outputs, packs their token ids."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def trim(self, ev: LoopEvent) -> tuple[LoopEvent, list[Tail], array]:
        """`ev` with each output cut to what the receiver lacks, the tails, and the ids frame.
        The engine's objects are not touched: the trimmed outputs are new ones."""
        ids, tails, outputs = array(_IDS), [], []
        for rid, out, new in ev.outputs:
            sent = self._sent.setdefault(rid, _Sent())
            trimmed, tail = self._trim_one(out, sent, ids)
            outputs.append((rid, trimmed, new))
            tails.append(tail)
        _forget_ended(self._sent, ev)
        return _with_outputs(ev, outputs), tails, ids

    @staticmethod
    def _trim_one(out: RequestOutput, sent: _Sent, ids: array) -> tuple[RequestOutput, Tail]:
        c, m = out.outputs[0], out.metrics
        num_prompt = 0 if sent.prompt else len(out.prompt_token_ids)
        if num_prompt:
            ids.extend(out.prompt_token_ids)
            sent.prompt = True
        ids_start = _start(sent.ids, len(c.token_ids))
        ids.extend(c.token_ids[ids_start:])
        sent.ids = len(c.token_ids)
        lp_start = _start(sent.logprobs, len(c.logprobs or ()))
        sent.logprobs = len(c.logprobs or ())
        t_start = _start(sent.times, len(m.token_times))
        sent.times = len(m.token_times)
        plp = out.prompt_logprobs
        plp_start = _start(sent.prompt_logprobs, len(plp or ()))
        sent.prompt_logprobs = len(plp or ())
        text_start = len(sent.text) if c.text.startswith(sent.text) else 0
        sent.text = c.text
        completion = CompletionOutput(
            c.index, c.text[text_start:], [], c.finish_reason, c.stop_reason,
            None if c.logprobs is None else c.logprobs[lp_start:], c.delta_text)
        metrics = RequestMetrics(
            m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
            m.finished_time, m.num_preemptions, m.token_times[t_start:])
        trimmed = RequestOutput(
            out.request_id, out.prompt, [], [completion], out.finished, metrics,
            out.num_cached_tokens, None if plp is None else plp[plp_start:], out.error)
        tail = Tail(num_prompt, ids_start, len(c.token_ids) - ids_start, lp_start, t_start,
                    plp_start, text_start)
        return trimmed, tail


class OutputReceiver:
    """The server's side, one per engine: rebuilds the cumulative outputs from the tails."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def restore(self, ev: LoopEvent, tails: list[Tail], frame: bytes) -> LoopEvent:
        """`ev` as the engine had it. ValueError when the tails do not fit the frame."""
        ids = array(_IDS)
        ids.frombytes(frame)
        if len(tails) != len(ev.outputs) or \
                sum(t.num_prompt_ids + t.num_ids for t in tails) != len(ids):
            raise ValueError(f"{len(tails)} tails and {len(ids)} ids do not fit "
                             f"{len(ev.outputs)} outputs")
        outputs, at = [], 0
        for (rid, out, new), tail in zip(ev.outputs, tails, strict=True):
            held = self._held.setdefault(rid, _Held())
            outputs.append((rid, self._restore_one(out, tail, held, ids, at), new))
            at += tail.num_prompt_ids + tail.num_ids
        _forget_ended(self._held, ev)
        return _with_outputs(ev, outputs)

    @staticmethod
    def _restore_one(out: RequestOutput, tail: Tail, held: _Held, ids: array,
                     at: int) -> RequestOutput:
        if tail.num_prompt_ids:
            held.prompt_ids = ids[at:at + tail.num_prompt_ids].tolist()
            at += tail.num_prompt_ids
        c, m = out.outputs[0], out.metrics
        held.ids = _join(held.ids, tail.ids_start, ids[at:at + tail.num_ids].tolist())
        held.logprobs = _join(held.logprobs, tail.logprobs_start, c.logprobs)
        held.times = _join(held.times, tail.times_start, m.token_times)
        held.prompt_logprobs = _join(held.prompt_logprobs, tail.prompt_logprobs_start,
                                     out.prompt_logprobs)
        held.text = held.text[:tail.text_start] + c.text
        c.token_ids, c.logprobs, m.token_times = held.ids, held.logprobs, held.times
        c.text = held.text
        out.prompt_token_ids, out.prompt_logprobs = held.prompt_ids, held.prompt_logprobs
        return out


def _with_outputs(ev: LoopEvent, outputs: list[tuple[str, RequestOutput, int]]) -> LoopEvent:
    return msgspec.structs.replace(ev, outputs=outputs)
