"""xgrammar against llguidance on this CPU, for issue 31's choice of a structured-output backend.

Both libraries, the default model's tokenizer (SmolLM2, 49,152 tokens), the same grammars: a
nested JSON schema (objects, enums, arrays with bounds, required fields), `json_object` (any
JSON object), a regex and a choice. For each it measures, in one process:
  - compile: the grammar for this tokenizer, cold (each library's cache cleared or bypassed);
  - mask: one step's token bitmask for a batch of 1 and of 32 requests, each walking its own
    grammar (a seeded random walk over allowed tokens, so every step is a real mid-document
    state), with each library's batch call for 32 (xgrammar: BatchGrammarMatcher; llguidance:
    fill_next_token_bitmask_par), and the advance (accepting the chosen token) timed apart.
Medians over --steps steps (after --warmup), printed with the CPU.

    .venv/bin/pip install xgrammar==0.2.9   # not a chunkserve dependency (llguidance is)
    .venv/bin/python benchmarks/kernels/grammar_backends.py [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
GRAMMARS: dict[str, tuple[str, Any]] = {
    "json_schema": ("json", PERSON),
    "json_object": ("json", {"type": "object"}),
    "regex": ("regex", r"\d{3}-\d{3}-\d{4}( ext\. \d{1,5})?"),
    "choice": ("regex", "(positive|negative|neutral)"),
}


def our_tokenizer() -> Any:
    """The engine's tokenizer (a `tokenizers.Tokenizer` inside): each library is set up from it
    directly, as the engine would, with no transformers tokenizer in between."""
    from chunkserve.model.loaders.source import load_source_tokenizer

    return load_source_tokenizer("smollm2-135m")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = tok.vocab_size
        vocab = [tok.hf_tokenizer.id_to_token(i) for i in range(self.vocab)]
        # SmolLM2's vocabulary is byte-level BPE (GPT-2's byte-to-unicode pieces).
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab,
                                      stop_token_ids=[tok.eos_token_id])

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        return compiler.compile_regex(spec)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> Any:
        return self.xgr.allocate_token_bitmask(n, self.vocab).numpy()

    def fill(self, matchers: list[Any], mask: Any) -> None:
        import torch

        t = torch.from_numpy(mask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(t, 0)
        else:
            self.xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask(matchers, t)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        import llguidance
        import llguidance.numpy

        self.lg, self.lgnp = llguidance, llguidance.numpy
        self.vocab = tok.vocab_size
        self.tok = llguidance.LLTokenizer(tok.hf_tokenizer.to_str(), n_vocab=self.vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: Any) -> Any:
        M = self.lg.LLMatcher
        grammar = (M.grammar_from_json_schema(json.dumps(spec)) if kind == "json"
                   else M.grammar_from_regex(spec))
        matcher = M(self.tok, grammar)  # compiles (lazily per state afterwards)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.lg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> Any:
        return self.lgnp.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers: list[Any], mask: Any) -> None:
        if len(matchers) == 1:
            self.lgnp.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.lgnp.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def allowed(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(backend: Any, compiled: Any, batch: int, steps: int, warmup: int,
         rng: np.random.Generator) -> tuple[float, float, float, int]:
    """(median fill seconds, median accept seconds per request, mean allowed tokens per mask,
    documents finished) over `steps` steps; a request whose document ends starts a new one."""
    matchers = backend.matchers(compiled, batch)
    mask = backend.bitmask(batch)
    fills: list[float] = []
    accepts: list[float] = []
    num_allowed: list[int] = []
    finished = 0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        backend.fill(matchers, mask)
        t1 = time.perf_counter()
        spent = 0.0
        for i, m in enumerate(matchers):
            choices = allowed(mask[i], backend.vocab)
            num_allowed.append(len(choices))
            token = int(rng.choice(choices)) if len(choices) else 0
            a = time.perf_counter()
            ok = len(choices) and backend.accept(m, token)
            spent += time.perf_counter() - a
            if not ok or backend.done(m):
                finished += 1
                matchers[i] = backend.matchers(compiled, 1)[0]
        if step >= warmup:
            fills.append(t1 - t0)
            accepts.append(spent / batch)
    return (statistics.median(fills), statistics.median(accepts),
            statistics.fmean(num_allowed), finished)


def measure(backend: Any, steps: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, spec) in GRAMMARS.items():
        t0 = time.perf_counter()
        compiled = backend.compile(kind, spec)
        compile_s = time.perf_counter() - t0
        row: dict[str, Any] = {"compile_ms": compile_s * 1e3}
        for batch in (1, 32):
            fill, accept, mean_allowed, finished = walk(backend, compiled, batch, steps,
                                                        warmup, np.random.default_rng(0))
            row[f"mask_b{batch}_ms"] = fill * 1e3
            row["accept_us"] = accept * 1e6
            row[f"allowed_b{batch}"] = mean_allowed
            row[f"documents_b{batch}"] = finished
        out[name] = row
        print(backend.name, name, {k: round(v, 3) for k, v in row.items()}, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    cpu = cpu_info()
    print(f"{cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['flags'])}")
    tok = our_tokenizer()
    makers: list[Callable[[], Any]] = [lambda: XGrammar(tok), lambda: LLGuidance(tok)]
    results = {}
    for make in makers:
        t0 = time.perf_counter()
        backend = make()
        setup = time.perf_counter() - t0
        print(f"{backend.name}: tokenizer set-up {setup:.2f} s", flush=True)
        results[backend.name] = {"tokenizer_setup_s": setup, **measure(backend, args.steps,
                                                                       args.warmup)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu, "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
