"""Phase (b): the disconnect storm. Streaming clients that hang up at random points: partway
through sending the body, right after sending it, once the headers came, after the first token,
mid-stream; plus non-streamed requests abandoned while they run. Every request the server took
must be aborted and its KV blocks freed (checked by the caller: idle within 5 s)."""
from __future__ import annotations

import asyncio
import json
import random
import time

from stress.report import PhaseResult
from stress.target import Target

MODES = ("mid-body", "before-headers", "after-headers", "after-first-token", "mid-stream",
         "non-stream")


def _request(target: Target, body: dict[str, object]) -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{target.port}\r\n"
            f"authorization: {target.headers['Authorization']}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode()
    return head, data


async def _one(target: Target, mode: str, rng: random.Random, max_tokens: int,
               result: PhaseResult) -> None:
    body = {"prompt": f"Story {rng.random():.6f}: once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": mode != "non-stream"}
    head, data = _request(target, body)
    result.requests += 1  # statuses only for the clients that stay for the headers
    reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
    try:
        if mode == "mid-body":
            writer.write(head + data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.2))
            return
        writer.write(head + data)
        await writer.drain()
        if mode == "before-headers":
            return
        if mode == "non-stream":
            await asyncio.sleep(rng.uniform(0.05, 1.0))
            return
        raw = await reader.readuntil(b"\r\n\r\n")
        status = int(raw.split(b" ", 2)[1])
        result.statuses[status] += 1
        if status != 200 or mode == "after-headers":
            return
        wanted = 1 if mode == "after-first-token" else rng.randint(2, max(2, max_tokens // 2))
        seen = b""
        while seen.count(b"data: {") < wanted:
            chunk = await reader.read(4096)
            if not chunk:
                if b"data: [DONE]" not in seen:  # the server hung up on a live stream
                    result.resets += 1
                return
            seen += chunk
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        result.resets += 1
        result.fail(f"{mode}: {type(e).__name__}: {e}")
    finally:
        writer.close()  # the disconnect itself
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def run_storm(target: Target, clients: int, concurrency: int, max_tokens: int,
              seed: int = 0) -> PhaseResult:
    result = PhaseResult("disconnect storm", allow_503=True)
    rng = random.Random(seed)
    modes = [MODES[i % len(MODES)] for i in range(clients)]
    rng.shuffle(modes)

    async def main() -> None:
        gate = asyncio.Semaphore(concurrency)

        async def limited(mode: str, r: random.Random) -> None:
            async with gate:
                await _one(target, mode, r, max_tokens, result)

        await asyncio.gather(*(limited(m, random.Random(rng.random())) for m in modes))

    start = time.monotonic()
    asyncio.run(main())
    result.seconds = time.monotonic() - start
    counts = {m: modes.count(m) for m in MODES}
    result.notes.append(f"{clients} clients cut: " + ", ".join(f"{m} {n}" for m, n in counts.items()))
    return result
