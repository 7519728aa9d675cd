"""What an engine process and the API server say to each other, as typed msgspec messages.

Front end -> engine: the loop's commands (engine/engine_loop.py's `Command`), one message
each; an `Add` of a long prompt carries its token ids in a second, raw int32 frame.
Engine -> front end: `EngineMessage`: `Ready` (loaded: what the server needs of it),
`StartFailed`, `Event` (a `LoopEvent` whose outputs hold only what the server has not seen,
with the step's token ids as raw int32s: engine/output_tails.py), and `Exited` (sent by a
headless node's launch when one of its engines ends). As in vLLM V1's msgpack encoder, raw
ids of RAW_FRAME_BYTES or more travel as a frame of their own (no copy into the message);
fewer ride inside it as msgpack bin, since a frame costs more than copying a few bytes. Every message frame is msgpack
decoded *as these types*, every raw frame as int32s: a peer can send wrong data, never code
(nothing here is unpickled).
"""
from __future__ import annotations

import dataclasses
from array import array
from typing import TYPE_CHECKING

import msgspec

from chunkserve.engine.engine_loop import Add, Command, LoopEvent
from chunkserve.engine.output_tails import OutputReceiver, OutputSender, Tail
from chunkserve.engine.processor import ProcessorSpec

if TYPE_CHECKING:
    from chunkserve.engine.llm_engine import LLMEngine


class EngineInfoSpec(msgspec.Struct, frozen=True):
    """What the API server needs of an engine it does not hold (frontend/engine_client.py's
    EngineInfo, with its Processor as data)."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str
    processor: ProcessorSpec | None  # None where the receiver holds the Processor itself

    @classmethod
    def of(cls, engine: LLMEngine, with_processor: bool = True) -> EngineInfoSpec:
        cc = engine.config.cache_config
        return cls(engine.config.model_config.model, engine.max_model_len,
                   engine.num_kv_blocks, cc.block_size, cc.kv_cache_dtype,
                   engine.processor.spec() if with_processor else None)


class Ready(msgspec.Struct, frozen=True, tag=True):
    index: int
    info: EngineInfoSpec


class StartFailed(msgspec.Struct, frozen=True, tag=True):
    index: int
    why: str


class Event(msgspec.Struct, tag=True):
    index: int
    event: LoopEvent  # its outputs trimmed by an OutputSender (engine/output_tails.py)
    tails: list[Tail] = msgspec.field(default_factory=list)  # one per output
    ids: bytes = b""  # the outputs' token ids (int32s), when not in a frame of their own


class Exited(msgspec.Struct, frozen=True, tag=True):
    """Engine `index` has ended: its node's report (`code`, its exit status), or node 0's
    own when the whole node went silent (`code` None). `why` completes "engine K died: ..."."""

    index: int
    code: int | None
    why: str


EngineMessage = Ready | StartFailed | Event | Exited

RAW_FRAME_BYTES = 1024  # raw ids this long or longer go as a frame of their own
_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_messages = msgspec.msgpack.Decoder(EngineMessage)


def encode(msg: object) -> bytes:
    """A one-frame message (every EngineMessage but Event: see event_frames)."""
    return _encoder.encode(msg)


def command_frames(command: Command) -> list[bytes]:
    if isinstance(command, Add) and \
            4 * len(command.request.prompt_token_ids) >= RAW_FRAME_BYTES:
        request = command.request  # its long prompt, the one large part, as raw int32s
        bare = Add(dataclasses.replace(request, prompt_token_ids=[]))
        return [_encoder.encode(bare), array("i", request.prompt_token_ids).tobytes()]
    return [_encoder.encode(command)]


def decode_command(frames: list[bytes]) -> Command:
    """msgspec.DecodeError or ValueError when the frames are not a command."""
    command = _commands.decode(frames[0])
    if len(frames) > 2 or len(frames) == 2 and not isinstance(command, Add):
        raise ValueError(f"a {type(command).__name__} does not come in {len(frames)} frames")
    if len(frames) == 2:
        ids = array("i")
        ids.frombytes(frames[1])
        command = Add(dataclasses.replace(command.request, prompt_token_ids=ids.tolist()))
    return command


def decode_message(frame: bytes) -> EngineMessage:
    return _messages.decode(frame)


def event_frames(index: int, ev: LoopEvent, sender: OutputSender) -> list[bytes]:
    """An Event's frames: the message, its outputs trimmed by `sender`, and their ids (in
    the message when short)."""
    trimmed, tails, ids = sender.trim(ev)
    raw = ids.tobytes()
    if len(raw) < RAW_FRAME_BYTES:
        return [_encoder.encode(Event(index, trimmed, tails, raw))]
    return [_encoder.encode(Event(index, trimmed, tails)), raw]


def restore_event(msg: Event, frames: list[bytes], receiver: OutputReceiver) -> LoopEvent:
    """The LoopEvent `msg` was made from; ValueError when its frames do not fit it."""
    if len(frames) > 2:
        raise ValueError(f"an Event does not come in {len(frames)} frames")
    return receiver.restore(msg.event, msg.tails, frames[1] if len(frames) == 2 else msg.ids)
