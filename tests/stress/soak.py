"""Phase (d): the soak. First the server's capacity for this request mix (requests/s with the
engine kept full), then a steady open-loop load at a fraction of it for N minutes, sampling the
server's RSS. One in twenty of the soak's arrivals are issue 51's sampling fuzz (stress/sampling_fuzz.py:
parameters at and past their bounds), which run in the same steps as the rest. Every well-formed
request must succeed, every ill-formed one get a 4xx naming its field; RSS must stop growing
once warmed up."""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from stress.report import PhaseResult
from stress.sampling_fuzz import expected_bad, is_refusal_naming, random_fields
from stress.sse import is_error_event
from stress.target import Target

RSS_SAMPLE_S = 10.0
MAX_GROWTH = 0.05  # the target: <= 5% RSS growth after the warm-up
# Of the soak's arrivals: sampling parameters at and past their bounds. Capacity is measured on
# the mix alone: a closed loop counts the fuzz's instant 400s as throughput.
FUZZ_FRACTION = 0.05


def mixed_request(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    """The issue's soak mix: stream or not, chat or completion, stop strings, n=2, logprobs."""
    body: dict[str, Any] = {"max_tokens": rng.randint(8, 32), "stream": rng.random() < 0.5,
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 999)}
    if rng.random() < 0.3:
        body["stop"] = [" the", "\n\n"]
    if rng.random() < 0.2:
        body["n"] = 2
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    topic = rng.choice(["a lighthouse", "the tides", "a violin", "old maps", "bread", "rivers"])
    if rng.random() < 0.5:
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        body["max_completion_tokens"] = body.pop("max_tokens")
        words = " ".join(rng.choice(["please", "briefly", "kindly", "now"]) for _ in range(rng.randint(1, 20)))
        body["messages"] = [{"role": "user", "content": f"Tell me about {topic} #{i}, {words}."}]
        return "/v1/chat/completions", body
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    body["prompt"] = f"Request {i}. A short essay on {topic}. " * rng.randint(1, 12)
    return "/v1/completions", body


def soak_request(rng: random.Random, i: int) -> tuple[str, dict[str, Any], set[str] | None]:
    """The mix, or (one arrival in twenty) a fuzzed sampling body; with the fields a fuzzed body
    got wrong (None for the mix's own requests)."""
    if rng.random() >= FUZZ_FRACTION:
        return (*mixed_request(rng, i), None)
    body = {"prompt": f"Request {i}. A note on", "max_tokens": 2, "stream": False,
            **random_fields(rng)}
    return "/v1/completions", body, expected_bad(body)


async def _send(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                result: PhaseResult, bad: set[str] | None = None) -> bool:
    """One request; False (and recorded) unless it completed, or (`bad`: the fields a fuzzed
    body got wrong) was refused naming one of them."""
    if bad:
        return await _send_refused(client, path, body, result, bad)
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                status, ok = r.status_code, bool(lines) and lines[-1] == "data: [DONE]" \
                    and not any(is_error_event(line) for line in lines)
        else:
            r = await client.post(path, json=body)
            status, ok = r.status_code, r.status_code == 200 and "choices" in r.json()
    except httpx.TransportError as e:
        result.requests += 1
        result.resets += 1
        result.fail(f"{path}: {type(e).__name__}: {e}")
        return False
    result.record(status)
    if not ok:
        result.fail(f"{path} {body}: status {status}, incomplete or error")
    return ok


async def _send_refused(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                        result: PhaseResult, bad: set[str]) -> bool:
    try:
        r = await client.post(path, content=json.dumps(body).encode(),  # NaN stays NaN
                              headers={"Content-Type": "application/json"})
    except httpx.TransportError as e:
        result.requests += 1
        result.resets += 1
        result.fail(f"{path}: {type(e).__name__}: {e}")
        return False
    result.record(r.status_code)
    error = r.json().get("error", {}) if r.status_code != 200 else {}
    ok = is_refusal_naming(r.status_code, error, bad)
    if not ok:
        result.fail(f"{path} {body}: status {r.status_code}, not a 4xx naming {sorted(bad)}")
    return ok


def measure_capacity(target: Target, seconds: float, concurrency: int, seed: int) -> float:
    """Completed requests/s of the mix with `concurrency` clients in a closed loop."""
    scratch = PhaseResult("capacity")
    rng = random.Random(seed)

    async def main() -> int:
        done = 0
        deadline = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=120) as c:
            async def worker() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    if await _send(c, *mixed_request(rng, done), scratch):
                        done += 1
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    start = time.monotonic()
    done = asyncio.run(main())
    return done / (time.monotonic() - start)


def run_soak(target: Target, minutes: float, load: float, calibrate_s: float, concurrency: int,
             seed: int = 0) -> PhaseResult:
    result = PhaseResult("soak")
    capacity = measure_capacity(target, calibrate_s, concurrency, seed)
    target.wait_idle()
    rate = load * capacity
    duration = minutes * 60
    warmup = min(300.0, duration / 2)  # the first 5 minutes, or half a short soak
    samples: list[tuple[float, float]] = []
    rng = random.Random(seed + 1)

    async def main() -> None:
        start = time.monotonic()
        tasks: set[asyncio.Task[bool]] = set()
        next_sample = start
        async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as c:
            i = 0
            while (now := time.monotonic()) < start + duration:
                if now >= next_sample:
                    samples.append((now - start, target.rss_mb()))
                    next_sample += RSS_SAMPLE_S
                path, body, bad = soak_request(rng, i)
                task = asyncio.create_task(_send(c, path, body, result, bad))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                # Steady arrivals at a fixed interval: a steady load, no bursts past the cap.
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            await asyncio.gather(*tasks)
        samples.append((time.monotonic() - start, target.rss_mb()))

    began = time.monotonic()
    asyncio.run(main())
    result.seconds = time.monotonic() - began
    _judge_rss(result, samples, warmup)
    result.notes.insert(0, f"capacity {capacity:.2f} req/s (closed loop, {concurrency} clients, "
                           f"{calibrate_s:.0f} s); soak at {load:.0%} = {rate:.2f} req/s for "
                           f"{minutes:g} min")
    return result


def _judge_rss(result: PhaseResult, samples: list[tuple[float, float]], warmup: float) -> None:
    start_mb = samples[0][1]
    after = [(t, mb) for t, mb in samples if t >= warmup] or samples[-1:]
    base_mb, end_mb = after[0][1], samples[-1][1]
    growth = (end_mb - base_mb) / base_mb
    slope = _slope_mb_per_min(after)
    result.notes.append(f"RSS {start_mb:.0f} MB at start, {base_mb:.0f} MB after the "
                        f"{warmup / 60:.1f}-min warm-up, {end_mb:.0f} MB at end: growth after "
                        f"warm-up {growth:+.2%}, slope {slope:+.2f} MB/min ({len(samples)} samples)")
    if growth > MAX_GROWTH:
        result.fail(f"RSS grew {growth:.1%} after the warm-up (limit {MAX_GROWTH:.0%})")


def _slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS against time."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 60 * sum((t - mt) * (r - mr) for t, r in points) / var
