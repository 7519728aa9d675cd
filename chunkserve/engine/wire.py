"""What an engine process and the API server say to each other, as typed msgspec messages.

Front end -> engine: the loop's commands (engine/engine_loop.py's `Command`), one per frame.
Engine -> front end: `EngineMessage`, one per frame: `Ready` (loaded: what the server needs of
it), `StartFailed`, `Event` (a `LoopEvent`), and `Exited` (sent by a headless node's launch
when one of its engines ends). Every frame is msgpack decoded *as these types*: a peer can
send wrong data, never code (nothing here is unpickled).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from chunkserve.engine.engine_loop import Command, LoopEvent
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
    event: LoopEvent


class Exited(msgspec.Struct, frozen=True, tag=True):
    """Engine `index` has ended: its node's report (`code`, its exit status), or node 0's
    own when the whole node went silent (`code` None). `why` completes "engine K died: ..."."""

    index: int
    code: int | None
    why: str


EngineMessage = Ready | StartFailed | Event | Exited

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_messages = msgspec.msgpack.Decoder(EngineMessage)


def encode(msg: object) -> bytes:
    return _encoder.encode(msg)


def decode_command(frame: bytes) -> Command:
    return _commands.decode(frame)


def decode_message(frame: bytes) -> EngineMessage:
    return _messages.decode(frame)
