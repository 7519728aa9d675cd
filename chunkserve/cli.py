"""`chunkserve` command line: generate, serve, bench serve|sweep, sim, profile, diagnose, tune,
export-dummy."""
from __future__ import annotations

import argparse
import sys
import time

from chunkserve.engine.arg_utils import add_engine_args, config_from_args, engine_kwargs


def _generate(args: argparse.Namespace) -> int:
    from chunkserve.llm import LLM
    from chunkserve.sampling_params import SamplingParams

    if args.node_rank > 0:  # a secondary node: its ranks only, node 0 generates
        from chunkserve.engine.tp.headless import run_headless

        return run_headless(config_from_args(args))
    llm = LLM(**engine_kwargs(_with_step_time(args, serving=False)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.monotonic()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)[0]
    elapsed = time.monotonic() - t0
    print(out.outputs[0].text)
    m = out.metrics
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.outputs[0].token_ids)} generated, "
        f"finish_reason={out.outputs[0].finish_reason}, TTFT {m.ttft * 1000:.0f} ms, "
        f"TPOT {(m.tpot or 0) * 1000:.1f} ms, {elapsed:.2f} s]",
        file=sys.stderr,
    )
    llm.engine.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkserve")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    from chunkserve.serve.launcher import add_server_args, run_server

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's flags)")
    add_server_args(srv)
    srv.set_defaults(func=lambda args: run_server(_with_step_time(args, serving=True)))

    from chunkserve.bench.cli import add_bench_parsers

    add_bench_parsers(sub)  # `bench serve`, ...: each registers in chunkserve/bench/cli.py

    from chunkserve.sim.cli import add_sim_args

    sim = sub.add_parser("sim", help="simulate the sweep for hardware you do not have")
    add_sim_args(sim)
    sim.set_defaults(func=_sim)
    prof = sub.add_parser("profile", help="calibrate the simulator's cost model on this machine")
    from chunkserve.bench.calibration import add_profile_args

    add_profile_args(prof)
    prof.set_defaults(func=_profile)

    from chunkserve.diagnose.cli import add_diagnose_args, run_diagnose

    diag = sub.add_parser("diagnose", help="attribute the slowest token gaps of a step trace")
    add_diagnose_args(diag)
    diag.set_defaults(func=run_diagnose)

    from chunkserve.engine.trace_cli import add_trace_args

    trace = sub.add_parser("trace", help="convert a step trace to a Perfetto timeline")
    add_trace_args(trace)

    from chunkserve.tune.cli import add_tune_args

    tune = sub.add_parser("tune", help="recommend chunking flags for a workload and SLOs "
                                       "(searched on the simulator)")
    add_tune_args(tune)
    tune.set_defaults(func=_tune)

    export = sub.add_parser("export-dummy", help="write a preset's shape with random weights "
                                                 "as a GGUF file or a HF folder")
    _add_export_args(export)
    export.set_defaults(func=_export_dummy)
    return parser


def _add_export_args(p: argparse.ArgumentParser) -> None:
    from chunkserve.model.writers.export import DEFAULT_QUANT, FORMATS

    p.add_argument("preset", help="a model preset (chunkserve/data/models.toml), e.g. "
                                  "llama-3.2-1b")
    p.add_argument("--format", default="gguf", choices=list(FORMATS),
                   help="gguf (llama.cpp) or hf (a safetensors folder: vLLM, transformers)")
    p.add_argument("--quant", default=None,
                   help="; ".join(f"{f}: {', '.join(q)} (default {DEFAULT_QUANT[f]})"
                                  for f, q in FORMATS.items()))
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (as --seed)")


def _export_dummy(args: argparse.Namespace) -> int:
    from chunkserve.model.writers.export import describe, export_dummy

    done = export_dummy(args.preset, args.format, args.out, args.quant, args.seed)
    print(done.path)
    print(f"[{done.nbytes / 2**30:.2f} GiB in {done.seconds:.0f} s; {describe(done.path)}]",
          file=sys.stderr)
    return 0


def _with_step_time(args: argparse.Namespace, serving: bool) -> argparse.Namespace:
    """Settles the chunk policy (arg_utils.default_chunk_policy) and adds the adaptive policy's
    step-time model (the engine's online one, or --cost-model's) to the engine flags. Built
    here because neither the engine nor the server may import the simulator's cost models; the
    command line is above both."""
    from chunkserve.engine.arg_utils import default_chunk_policy
    from chunkserve.sim.step_cost import step_time_kwargs

    args.chunk_policy = default_chunk_policy(args, serving)
    model = getattr(args, "model_tag", None) or args.model  # `serve MODEL` names it first
    for key, value in step_time_kwargs(args.chunk_policy, args.cost_model, model).items():
        setattr(args, key, value)
    return args


def _sim(args: argparse.Namespace) -> int:
    from chunkserve.sim.cli import run_sim

    # --validate's real runs need the model: the benchmarks measure them, the simulator scores.
    if args.validate and not args.real_runs:
        from chunkserve.bench.validation_runs import measure_real_runs

        return run_sim(args, measure_real_runs)
    return run_sim(args)


def _tune(args: argparse.Namespace) -> int:
    from chunkserve.tune.cli import run_tune

    # --verify's real runs need the model: the benchmarks make them, tune compares.
    if args.verify:
        from chunkserve.bench.tune_runs import measure_tune_runs

        return run_tune(args, measure_tune_runs)
    return run_tune(args)


def _profile(args: argparse.Namespace) -> int:
    from chunkserve.bench.calibration import run_profile

    return run_profile(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        # Bad input is the user's to fix: a one-line message, not a traceback.
        print(f"chunkserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
