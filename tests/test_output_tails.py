"""What of each output crosses from an engine process (engine/output_tails.py, issue 52): only
the tails the server lacks, token ids as a raw int32 frame, and the server rebuilds exactly the
cumulative outputs the engine made, step by step, forgetting each request once it ended."""
from __future__ import annotations

import queue
from array import array

import msgspec
import pytest

from chunkserve.config import EngineConfig
from chunkserve.engine import wire
from chunkserve.engine.engine_loop import STOP, Abort, Add, EngineLoop, LoopEvent
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.output_tails import OutputReceiver, OutputSender
from chunkserve.engine.processor import EngineRequest
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.sampling_params import SamplingParams

_full = msgspec.msgpack.Decoder(wire.Event)


def _copy(ev: LoopEvent) -> LoopEvent:
    """`ev` as it was at emit time (the engine goes on mutating its metrics)."""
    return _full.decode(wire.encode(wire.Event(0, ev))).event


def test_a_real_engine_s_outputs_cross_as_tails_and_come_back_whole(tiny_model_dir: str) -> None:
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(
        model=tiny_model_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=256))
    processor = engine.processor
    commands: queue.Queue[object] = queue.Queue()
    sender, receiver = OutputSender(), OutputReceiver()
    sent_bytes, sent_ids, full_bytes, events, restored = [0], [0], [0], [], []
    wanted = {
        "lp": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2),
        # Greedy, it writes what "lp" does: "... ASD Strong soap ...".
        "stop": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                               stop=[" Strong"]),
        "abort": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        "plain": SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True),
    }
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs into the woods. " * 4
    for rid, params in wanted.items():
        commands.put(Add(processor.process_inputs(rid, prompt, params)))
    finished: set[str] = set()

    def emit(ev: LoopEvent) -> None:
        events.append(_copy(ev))
        frames = wire.event_frames(0, ev, sender)
        sent_bytes[0] += sum(map(len, frames))
        full_bytes[0] += len(wire.encode(wire.Event(0, ev)))
        msg = wire.decode_message(frames[0])
        assert isinstance(msg, wire.Event)
        sent_ids[0] += len(frames[1] if len(frames) == 2 else msg.ids) // 4
        restored.append(wire.restore_event(msg, frames, receiver))
        for rid, out, _ in ev.outputs:
            if out.finished:
                finished.add(rid)
            if rid == "abort" and len(out.outputs[0].token_ids) >= 3:
                commands.put(Abort("abort"))
        finished.update(ev.aborted)
        if finished == set(wanted):
            commands.put(STOP)

    EngineLoop(engine, commands, emit).run()
    assert restored == events
    outs = {rid: out for ev in restored for rid, out, _ in ev.outputs}
    assert len(outs["lp"].prompt_logprobs) == len(outs["lp"].prompt_token_ids) > 16  # chunked
    assert len(outs["lp"].outputs[0].logprobs) == 12
    assert outs["stop"].outputs[0].finish_reason == "stop"
    assert not sender._sent and not receiver._held  # every request forgotten once it ended
    # Each token id crossed once (the prompt's with the first output), and the frames were
    # under half the bytes of the whole outputs (a step's record and stats are sent either way).
    assert sent_ids[0] == sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
                              for o in outs.values())
    assert sent_bytes[0] * 2 < full_bytes[0]


def _output(rid: str, prompt: list[int], ids: list[int], text: str,
            finished: bool = False) -> RequestOutput:
    metrics = RequestMetrics(0.0, token_times=[float(i) for i in range(len(ids))])
    return RequestOutput(rid, None, prompt, [CompletionOutput(0, text, ids)], finished, metrics)


def test_the_ids_are_the_prompt_once_then_each_step_s_new_ids() -> None:
    sender = OutputSender()
    first = LoopEvent(outputs=[("a", _output("a", [7, 8, 9], [1], "x"), 1)])
    _, tails, ids = sender.trim(first)
    assert ids == array("i", [7, 8, 9, 1]) and tails[0].num_prompt_ids == 3
    second = LoopEvent(outputs=[("a", _output("a", [7, 8, 9], [1, 2], "xy"), 1)])
    trimmed, tails, ids = sender.trim(second)
    assert ids == array("i", [2]) and (tails[0].num_prompt_ids, tails[0].ids_start) == (0, 1)
    assert trimmed.outputs[0][1].outputs[0].text == "y"
    long = LoopEvent(outputs=[("b", _output("b", list(range(300)), [1], "x"), 1)])
    frames = wire.event_frames(0, long, sender)  # 301 ids: a frame of their own
    assert len(frames) == 2 and frames[1] == array("i", [*range(300), 1]).tobytes()
    back = wire.restore_event(wire.decode_message(frames[0]), frames, OutputReceiver())
    assert back.outputs[0][1].prompt_token_ids == list(range(300))


def test_a_text_cut_by_a_stop_string_is_sent_whole() -> None:
    sender, receiver = OutputSender(), OutputReceiver()
    for text, done in (("hello wor", False), ("hello", True)):
        ev = LoopEvent(outputs=[("a", _output("a", [5], [1, 2], text, done), 1)])
        frames = wire.event_frames(0, ev, sender)
        back = wire.restore_event(wire.decode_message(frames[0]), frames, receiver)
        assert back.outputs[0][1].outputs[0].text == text


def test_an_event_whose_ids_do_not_fit_its_tails_is_refused() -> None:
    ev = LoopEvent(outputs=[("a", _output("a", [5, 6], [1], "x"), 1)])
    frames = wire.event_frames(0, ev, OutputSender())
    msg = wire.decode_message(frames[0])
    assert len(frames) == 1  # 3 ids ride inside the message
    with pytest.raises(ValueError, match="do not fit"):
        wire.restore_event(msg, [frames[0], msg.ids[:4]], OutputReceiver())
    with pytest.raises(ValueError, match="3 frames"):
        wire.restore_event(msg, [frames[0], b"", b""], OutputReceiver())


def test_an_add_carries_its_prompt_as_a_raw_frame() -> None:
    request = EngineRequest("r", None, list(range(1000)), SamplingParams(max_tokens=2), [2])
    frames = wire.command_frames(Add(request))
    assert frames[1] == array("i", range(1000)).tobytes() and len(frames[0]) < 1000
    assert wire.decode_command(frames) == Add(request)
    short = Add(EngineRequest("s", None, [1, 2, 3], SamplingParams(max_tokens=2), [2]))
    assert len(wire.command_frames(short)) == 1  # a few ids ride inside the message
    with pytest.raises(ValueError, match="does not come in 2 frames"):
        wire.decode_command([wire.encode(Abort("r")), b"\0\0\0\0"])
