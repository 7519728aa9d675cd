"""What encoding one step's event costs, engine side and server side: whole cumulative outputs as
msgpack (the wire before engine/output_tails.py) against the tails with raw token ids (issue 52).

Synthetic events of --requests decoding requests, each with a --prompt-len prompt and
--output-len tokens so far (text, timestamps and, with --logprobs N, top-N logprobs for each);
each repetition grows every request by one token, as a decode step does, and times both codecs
on it, alternating, so a neighbour's burst spoils a pair, not a column. No model, no sockets:
the step-event latency with engines and sockets is dp_transport.py's.

    .venv/bin/python benchmarks/engine/event_codec.py [--requests 32] [--prompt-len 1000]
        [--output-len 256] [--logprobs 0] [--repeats 200]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import msgspec  # noqa: E402

from benchmarks.common.host import cpu_model  # noqa: E402
from chunkserve.engine import wire  # noqa: E402
from chunkserve.engine.engine_loop import LoopEvent  # noqa: E402
from chunkserve.engine.output_tails import OutputReceiver, OutputSender  # noqa: E402
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402

_whole = msgspec.msgpack.Decoder(wire.Event)


def _event(args: argparse.Namespace, rng: random.Random) -> LoopEvent:
    ev = LoopEvent()
    for r in range(args.requests):
        n = args.output_len
        logprobs = None if args.logprobs is None else \
            [[(1, -0.5), *((j, -1.0) for j in range(args.logprobs))] for _ in range(n)]
        c = CompletionOutput(0, "tok " * n, [rng.randrange(49152) for _ in range(n)],
                             logprobs=logprobs)
        m = RequestMetrics(0.0, token_times=[0.01 * i for i in range(n)])
        prompt = [rng.randrange(49152) for _ in range(args.prompt_len)]
        ev.outputs.append((f"r{r}", RequestOutput(f"r{r}", None, prompt, [c], False, m), 1))
    return ev


def _grow(ev: LoopEvent, rng: random.Random) -> None:
    """One decode step: every request one token longer (new objects, as the engine makes)."""
    for i, (rid, out, _) in enumerate(ev.outputs):
        c, m = out.outputs[0], out.metrics
        lp = None if c.logprobs is None else [*c.logprobs, c.logprobs[0]]
        c2 = CompletionOutput(0, c.text + "tok ", [*c.token_ids, rng.randrange(49152)],
                              logprobs=lp)
        m.token_times.append(m.token_times[-1] + 0.01)
        ev.outputs[i] = (rid, RequestOutput(rid, None, out.prompt_token_ids, [c2], False, m), 1)


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    rng = random.Random(0)
    ev = _event(args, rng)
    sender, receiver = OutputSender(), OutputReceiver()
    wire.restore_event(wire.decode_message((f := wire.event_frames(0, ev, sender))[0]), f, receiver)
    cols: dict[str, list[float]] = {k: [] for k in ("whole enc", "whole dec", "tails enc",
                                                    "tails dec")}
    sizes = {"whole": 0, "tails": 0}
    for _ in range(args.repeats):
        _grow(ev, rng)
        box: dict[str, object] = {}
        cols["whole enc"].append(_timed(lambda: box.update(w=wire.encode(wire.Event(0, ev)))))
        cols["whole dec"].append(_timed(lambda: _whole.decode(box["w"])))
        cols["tails enc"].append(_timed(lambda: box.update(t=wire.event_frames(0, ev, sender))))
        frames = box["t"]
        cols["tails dec"].append(_timed(lambda: wire.restore_event(
            wire.decode_message(frames[0]), frames, receiver)))  # type: ignore[index]
        sizes["whole"], sizes["tails"] = len(box["w"]), sum(map(len, frames))  # type: ignore
    print(f"# {cpu_model()}; {args.requests} requests, {args.prompt_len}-token prompts, "
          f"{args.output_len}+ output tokens, logprobs {args.logprobs}, {args.repeats} steps")
    print("| codec | bytes a step | engine side: encode (median us) | server side: decode "
          "(median us) |")
    print("|---|---:|---:|---:|")
    for name in ("whole", "tails"):
        enc = 1e6 * statistics.median(cols[f"{name} enc"])
        dec = 1e6 * statistics.median(cols[f"{name} dec"])
        print(f"| {name} | {sizes[name]:,} | {enc:.0f} | {dec:.0f} |")


if __name__ == "__main__":
    main()
