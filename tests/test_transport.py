"""The engine transport (issue 52): typed msgspec messages over ZeroMQ with CURVE keyed from a
shared secret (engine/wire.py, engine/channel.py, frontend/core_client.py).

A peer without the secret is refused at the handshake with a log line and none of its frames
reaches a client; one with it is heard; a malformed frame is dropped, never decoded into
anything but the message types; and nothing in the package unpickles bytes."""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
import time
from collections.abc import Iterator

import pytest
import zmq

import chunkserve
from chunkserve.engine import wire
from chunkserve.engine.channel import Keys, engine_socket, secret_from_env
from chunkserve.engine.engine_loop import (
    STOP, Abort, Add, EngineDeadError, LoopError, LoopEvent, RequestFailedError, ShuttingDownError,
)
from chunkserve.engine.output_tails import OutputReceiver, OutputSender
from chunkserve.engine.processor import EngineRequest, ProcessorSpec
from chunkserve.frontend.core_client import CoreClient, EngineHub
from chunkserve.sampling_params import SamplingParams

INFO = wire.EngineInfoSpec("m", 64, 8, 16, "auto", ProcessorSpec(64, 100, [2], None))


def _send_ready(address: str, keys: Keys | None, index: int = 1) -> None:
    """Connects a PUSH as an engine would (with `keys`, or plain without CURVE) and says Ready."""
    ctx = zmq.Context()
    if keys is None:
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 500
    else:
        sock = engine_socket(ctx, zmq.PUSH, keys)
        sock.linger = 500
    sock.connect(address)
    sock.send(wire.encode(wire.Ready(index, INFO)))
    sock.close()
    ctx.term()


@pytest.fixture
def hub() -> Iterator[EngineHub]:
    h = EngineHub(b"the right secret", tcp=True)
    yield h
    h.close()


def _events_address(hub: EngineHub) -> str:
    assert hub.remote_ports is not None
    return f"tcp://127.0.0.1:{hub.remote_ports[1]}"


@pytest.mark.parametrize("keys", [Keys.of(b"a wrong secret"), None], ids=["wrong", "none"])
def test_an_engine_without_the_secret_is_refused(hub: EngineHub, keys: Keys | None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    client = CoreClient(hub, 1, None, node=1)
    with caplog.at_level(logging.ERROR, logger="chunkserve.server"):
        _send_ready(_events_address(hub), keys)
        with pytest.raises(ValueError, match="did not load within 1 s"):
            client.wait_ready(1.0)
        deadline = time.monotonic() + 5
        while "refused" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert re.search(r"refused .*(connection).*shared secret", caplog.text), caplog.text


def test_an_engine_with_the_secret_is_heard(hub: EngineHub) -> None:
    client = CoreClient(hub, 1, None, node=1)
    _send_ready(_events_address(hub), Keys.of(b"the right secret"))
    info = client.wait_ready(10.0)
    assert (info.max_model_len, info.block_size, info.processor.eos_token_ids) == (64, 16, [2])


def test_a_malformed_frame_is_dropped_with_a_log_line(hub: EngineHub,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    client = CoreClient(hub, 1, None, node=1)
    ctx = zmq.Context()
    sock = engine_socket(ctx, zmq.PUSH, Keys.of(b"the right secret"))
    sock.connect(_events_address(hub))
    with caplog.at_level(logging.ERROR, logger="chunkserve.server"):
        # A pickle of a Ready, and a message of the right shape for an unknown engine.
        sock.send(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.")
        sock.send(wire.encode(wire.Ready(7, INFO)))
        sock.send(wire.encode(wire.Ready(1, INFO)))
        client.wait_ready(10.0)  # the good frame after them still arrives
    sock.close()
    ctx.term()
    assert "dropped a malformed engine message" in caplog.text
    assert "dropped a message from engine 7" in caplog.text


def test_commands_and_events_round_trip_as_their_types() -> None:
    request = EngineRequest("r1", "hi", [1, 2, 3], SamplingParams(max_tokens=4, seed=3), [2])
    for command in (Add(request), Abort("r1"), STOP):
        assert wire.decode_command(wire.command_frames(command)) == command
    errors = [ShuttingDownError("bye"), EngineDeadError("gone"), RequestFailedError("row", 400),
              ValueError("bad"), RuntimeError("boom")]
    ev = LoopEvent(errors=[(f"r{i}", LoopError.of(e)) for i, e in enumerate(errors)])
    frames = wire.event_frames(0, ev, OutputSender())
    msg = wire.decode_message(frames[0])
    assert isinstance(msg, wire.Event)
    back = wire.restore_event(msg, frames, OutputReceiver())
    assert back == ev
    for (_, err), original in zip(back.errors, errors, strict=True):
        exc = err.exception()
        assert type(exc) is type(original) and str(exc) == str(original)
    assert back.errors[2][1].exception().status == 400  # type: ignore[attr-defined]


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("CHUNKSERVE_SECRET", raising=False)
    monkeypatch.delenv("CHUNKSERVE_SECRET_FILE", raising=False)
    assert secret_from_env() is None
    monkeypatch.setenv("CHUNKSERVE_SECRET", "abc")
    assert secret_from_env() == b"abc"
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    monkeypatch.setenv("CHUNKSERVE_SECRET_FILE", str(path))
    assert secret_from_env() == b"from-a-file"
    monkeypatch.setenv("CHUNKSERVE_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read it"):
        secret_from_env()


def test_nothing_in_the_package_unpickles() -> None:
    """No pickle (or cloudpickle, or torch.distributed's pickling object collectives) anywhere in
    chunkserve/: every byte read from a socket or a store is decoded as a declared type."""
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill)\b|"
                         r"\b(c?pickle|cloudpickle|dill)\.(loads?|Unpickler)\b|"
                         r"_object_list\(|recv_object\(|broadcast_object\(|\.queue_pop\(")
    found = [f"{path.relative_to(pathlib.Path(chunkserve.__file__).parent)}:{n}: {line.strip()}"
             for path in pathlib.Path(chunkserve.__file__).parent.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line.split("#")[0])]
    assert not found, "\n".join(found)


def test_a_step_reaches_the_tensor_parallel_workers_as_its_runner_reads_it() -> None:
    import numpy as np

    from chunkserve.core.request import Request
    from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
    from chunkserve.engine.tp import step_wire

    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, seed=1), 0.0, [2])
    req.append_output_token(9)
    out = SchedulerOutput([ScheduledRequest(req, 1, 3, True, [[4, 0]], True)],
                          finished_req_ids=["old"], blocks_to_swap_out=[(1, 2)],
                          grammar_bitmask={"r": np.array([-1, 7], dtype=np.int32)})
    back = step_wire.decode_step(step_wire.encode_step(out))
    s = back.scheduled[0]
    assert (s.token_ids, s.start, s.block_tables, s.samples) == ([9], 3, [[4, 0]], True)
    assert (dataclasses.asdict(s.request.sampling_params)
            == dataclasses.asdict(req.sampling_params))
    assert (s.request.output_token_ids, s.request.eos_token_ids) == ([9], [2])
    assert back.finished_req_ids == ["old"] and back.blocks_to_swap_out == [(1, 2)]
    assert back.grammar_bitmask["r"].tolist() == [-1, 7]
