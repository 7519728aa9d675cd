"""`chunkserve bench serve`: an open-loop load generator with `vllm bench serve`'s flags, table and
result JSON, so numbers from chunkserve and from vLLM (or any OpenAI-compatible server) line up.

Open loop: requests leave at their scheduled arrival times whether or not earlier ones have
finished (unless --max-concurrency caps them), so a slow server shows up as queueing, not as a
gentler load.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from chunkserve.benchlib.args import add_workload_args, workload_requests
from chunkserve.benchlib.metrics import (
    METRIC_NAMES,
    RequestResult,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    print_summary,
)
from chunkserve.benchlib.workloads import BenchRequest, arrival_times

if TYPE_CHECKING:
    import aiohttp

# Per-request ceiling, as in vLLM: long enough that only a hung server hits it.
_REQUEST_TIMEOUT_S = 6 * 60 * 60
_BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions",
             "openai-chat": "/v1/chat/completions"}
_SYNTHETIC = ("random", "mixed", "sharegpt-like", "shared-prefix")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    conn = p.add_argument_group("server")
    conn.add_argument("--backend", choices=sorted(_BACKENDS), default=None,
                      help="request format; default from --endpoint (openai, or openai-chat)")
    conn.add_argument("--base-url", default=None, help="e.g. http://host:8000 (else --host/--port)")
    conn.add_argument("--host", default="127.0.0.1")
    conn.add_argument("--port", type=int, default=8000)
    conn.add_argument("--endpoint", default=None,
                      help="/v1/completions (default) or /v1/chat/completions")
    conn.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    conn.add_argument("--tokenizer", default=None,
                      help="chunkserve model name or path whose tokenizer sizes prompts "
                           "(default: --model)")
    conn.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="bearer token (default: $OPENAI_API_KEY)")

    add_workload_args(p.add_argument_group("workload"), dataset_name="random", num_prompts=1000)

    load = p.add_argument_group("traffic")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second ('inf': all at once)")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0,
                      help="untimed copies of the first request sent before the run")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="send ignore_eos (a vLLM extension) so outputs run to full length; "
                           "default on for the synthetic datasets (as vLLM does for random)")
    load.add_argument("--temperature", type=float, default=None,
                      help="sent only when given (else the server's default)")

    out = p.add_argument_group("results")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help=f"comma-separated subset of {','.join(METRIC_NAMES)}")
    out.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true",
                     help="also save per-request lengths, timings, texts and errors")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--disable-tqdm", action="store_true")


async def _first_model(session: aiohttp.ClientSession, base_url: str,
                       headers: dict[str, str]) -> tuple[str, str | None]:
    """(id, root) of the first served model; root is vLLM's "where it was loaded from"."""
    import aiohttp

    try:
        async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            models = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise ValueError(f"could not list models at {base_url}/v1/models ({e}); is the server "
                         "up and --api-key right? Or pass --model to skip this lookup.") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models")
    return models[0]["id"], models[0].get("root")


def _load_tokenizer(candidates: list[str]) -> tuple[str, Any]:
    from chunkserve.model.loaders.source import load_source_tokenizer

    errors = []
    for name in dict.fromkeys(c for c in candidates if c):
        try:
            return name, load_source_tokenizer(name)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError("no usable tokenizer (pass --tokenizer with a chunkserve model name or "
                     "path): " + "; ".join(errors))


def _result_path(args: argparse.Namespace, backend: str, model_id: str, date: str) -> str:
    # vLLM's default name: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"{backend}-{args.request_rate}qps{concurrency}-{model_id.rstrip('/').split('/')[-1]}"
        f"-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


async def _run(args: argparse.Namespace, session: aiohttp.ClientSession, url: str,
               headers: dict[str, str], requests: list[BenchRequest], model: str,
               ignore_eos: bool, count_tokens: Any) -> tuple[list[RequestResult], float]:
    from chunkserve.bench.client import (
        build_payload,
        is_chat_endpoint,
        json_schema_body,
        send_request,
    )

    chat = is_chat_endpoint(url)

    def payload(req: BenchRequest) -> dict[str, Any]:
        extra = (json_schema_body(chat=chat, schema=req.json_schema)
                 if req.json_schema is not None else None)
        return build_payload(chat=chat, model=model, prompt=req.prompt, output_len=req.output_len,
                             ignore_eos=ignore_eos, temperature=args.temperature,
                             extra_body=extra)

    async def one(req: BenchRequest) -> RequestResult:
        return await send_request(session, url, payload(req), prompt_len=req.prompt_len,
                                  headers=headers, count_tokens=count_tokens)

    if args.num_warmups > 0:
        print(f"Warming up with {args.num_warmups} requests...")
        await asyncio.gather(*(one(requests[0]) for _ in range(args.num_warmups)))

    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        pbar = tqdm(total=len(requests))
    limit = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
             else contextlib.nullcontext())

    async def limited(req: BenchRequest) -> RequestResult:
        async with limit:
            result = await one(req)
        if pbar is not None:
            pbar.update(1)
        return result

    offsets = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    start = time.perf_counter()
    tasks = []
    for req, offset in zip(requests, offsets):
        # Sleep to each absolute offset (not per gap) so scheduling lag does not accumulate.
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return list(results), duration


def _parse_metric_args(args: argparse.Namespace) -> tuple[list[str], list[float],
                                                          dict[str, float]]:
    """(--percentile-metrics, --metric-percentiles, --goodput), checked."""
    percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = set(percentile_metrics) - set(METRIC_NAMES)
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {sorted(bad)}; choose from {METRIC_NAMES}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    percentiles = parse_percentiles(args.metric_percentiles)
    return percentile_metrics, percentiles, parse_goodput(args.goodput)


async def _bench(args: argparse.Namespace) -> int:
    import aiohttp

    from chunkserve.bench.client import is_chat_endpoint

    percentile_metrics, percentiles, slos = _parse_metric_args(args)
    endpoint = args.endpoint or _BACKENDS[args.backend or "openai"]
    backend = args.backend or ("openai-chat" if is_chat_endpoint(endpoint) else "openai")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name in _SYNTHETIC

    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    # force_close: one connection per request. A kept-alive connection that sat idle past the
    # server's keep-alive timeout (uvicorn: 5 s) can be closed by the server just as the client
    # reuses it; under sparse open-loop arrivals that failed requests with "Server
    # disconnected" against both chunkserve and llama-server. A loopback connect costs ~0.1 ms.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=True)
    # read_bufsize: SSE lines longer than aiohttp's 64 KiB default would fail a request.
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     read_bufsize=2**20) as session:
        model_id, root = args.model, None
        if model_id is None:
            model_id, root = await _first_model(session, base_url, headers)
            print(f"Model: {model_id}")
        tokenizer_id, tokenizer = _load_tokenizer([args.tokenizer] if args.tokenizer
                                                  else [model_id, root])
        requests = workload_requests(args, tokenizer)
        distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        results, duration = await _run(args, session, url, headers, requests, model_id,
                                       ignore_eos, count_tokens)

    failed = [r for r in results if not r.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, r in enumerate(failed[:10]):
            print(f"Error {i}: {r.error}")
    metrics = compute_metrics(results, duration, percentiles, slos)
    print_summary(metrics, selected_percentile_metrics=percentile_metrics,
                  selected_percentiles=percentiles, max_concurrency=args.max_concurrency,
                  request_rate=args.request_rate)
    if args.dataset_name == "json-schema":
        _print_json_parsed(results)
    if args.save_result or args.save_detailed:
        _save_result(args, results, {
            "backend": backend, "model_id": model_id, "tokenizer_id": tokenizer_id,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "dataset_name": args.dataset_name, "endpoint": endpoint, "ignore_eos": ignore_eos,
            "goodput_slos_ms": slos, **metrics})
    return 0


def _print_json_parsed(results: list[RequestResult]) -> None:
    """How many outputs parse as JSON. A completed request whose output does not parse ran out of
    max_tokens mid-object, or went to a server that ignored the schema."""
    def parses(text: str) -> bool:
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    parsed = sum(parses(r.generated_text) for r in results if r.success)
    print("{:<40} {:<10}".format("Outputs that parse as JSON:", f"{parsed}/{len(results)}"))


def _save_result(args: argparse.Namespace, results: list[RequestResult],
                 record: dict[str, Any]) -> None:
    """The run's JSON as vLLM's `--save-result` writes it (`--save-detailed`: per request too)."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {"date": date, **record}
    if args.save_detailed:
        record.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_len if r.success else 0 for r in results],
            ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
            latencies=[r.latency for r in results],
            start_times=[r.start_time for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results])
    path = _result_path(args, record["backend"], record["model_id"], date)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(f"Saved results to {path}")


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401  # imported late so `chunkserve serve` works without it
    except ImportError:
        raise ValueError("`chunkserve bench serve` needs aiohttp: pip install aiohttp") from None
    return asyncio.run(_bench(args))

