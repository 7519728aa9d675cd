"""The import direction between packages (README, "How the code is laid out"), enforced.

    core ← engine ← (serve, bench);  benchlib ← (bench, sim);  sim ← bench;
    (sim, benchlib, diagnose) ← tune;  tokenizer ← model ← engine
    procs ← engine ← frontend ← serve   (serve/: HTTP alone; SERVE_ALLOWED orders its parts)

`core` is pure Python; `model` never imports `engine`; `sim` runs the engine with a cost model
and never imports `model/` or `bench/` (real measurement lives with the benches). Inside
`model/`, its sub-packages are layered by role too (MODEL_ALLOWED). Every import counts,
function-level ones included: a lazy import is still an arrow.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import chunkserve

ROOT = pathlib.Path(chunkserve.__file__).parent
# Top-level modules with no arrows out.
LEAVES = {"config", "sampling_params", "outputs", "presets", "gguf_file", "layer_types"}
ALLOWED = {
    "core": {"config", "sampling_params"},
    # The tokenizer (and chat template) reads model files but no weights.
    "tokenizer": {"presets", "gguf_file"},
    "model": {"config", "presets", "tokenizer", "gguf_file", "layer_types"},
    # Process lifecycles (spawn, liveness, join-then-kill, placement): the bottom of the house.
    "procs": {"config"},
    "engine": {"procs", "core", "model", "tokenizer", "config", "sampling_params", "outputs"},
    # vLLM's AsyncLLM and its core clients: engines in this process, others, other machines.
    "frontend": {"procs", "engine", "core", "config", "sampling_params", "outputs", "tokenizer"},
    "benchlib": {"core", "engine", "config", "sampling_params", "outputs"},
    # layer_types: which layers of a config.json slide, read by the model and the simulator.
    "sim": {"benchlib", "core", "engine", "config", "sampling_params", "outputs", "presets",
            "layer_types"},
    "serve": {"frontend", "procs", "core", "engine", "model", "tokenizer", "config",
              "sampling_params", "outputs", "__init__"},
    "bench": {"benchlib", "sim", "core", "engine", "model", "tokenizer", "config",
              "sampling_params", "outputs", "presets"},
    # diagnose reads step traces; tune searches on the simulator and explains with diagnose.
    "diagnose": {"engine", "config"},
    "tune": {"sim", "benchlib", "diagnose", "core", "engine", "config", "presets"},
    **{leaf: set() for leaf in LEAVES},
}
# model/ by role: kernels (C and Triton sources, their builders) at the bottom; linear formats
# and layer ops, and attention backends, over them; the architectures over those; the loaders
# read checkpoints into an architecture's names. `batch` (a step's flat arrays) is read by the
# attention backends; `factory` (load_model) at the top assembles it all.
MODEL_ALLOWED = {
    "kernels": set(),
    "batch": set(),
    "layers": {"kernels"},
    "attention": {"kernels", "batch"},
    "models": {"layers", "attention", "batch"},
    "loaders": {"models"},
    # The loaders' inverse: a model written to a file (export-dummy), read back by the loaders.
    "writers": {"models", "loaders"},
    # Tensor parallelism: what each rank holds (parallel), and the collectives around it.
    "parallel": {"models"},
    "tp_layers": {"models", "parallel"},
    # A decode step's layers in one C call: the model's weights, kernels and attention data.
    "fused_decode": {"models", "layers", "attention", "kernels"},
    "factory": {"models", "loaders", "attention", "layers", "kernels", "batch", "parallel",
                "tp_layers"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The chunkserve modules a file imports, relative imports resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in found if m == "chunkserve" or m.startswith("chunkserve.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_packages_import_only_downwards() -> None:
    bad = []
    for module, targets in _graph().items():
        src = _package(module)
        if src not in ALLOWED:  # entry points: cli, llm, the package __init__
            continue
        for target in targets:
            dst = _package(target)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))


# serve/ by role: the HTTP plumbing and the leaf modules the handlers read (admission, the
# metrics, the step stream: "leaf") at the bottom, the OpenAI protocol over them, the other
# routes over that, and the app and launcher ("top") over all of them.
SERVE_LEAVES = {"admission", "metrics", "step_stream"}
SERVE_ALLOWED = {
    "http": set(),
    "leaf": set(),
    "openai": {"http", "leaf"},
    "routes": {"http", "leaf", "openai"},
    "top": {"http", "leaf", "openai", "routes"},
}


def _serve_part(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "serve":
        return None
    if parts[2] in ("http", "openai", "routes"):
        return parts[2]
    return "leaf" if parts[2] in SERVE_LEAVES else "top"


def test_serve_parts_import_only_downwards() -> None:
    bad = []
    for module, targets in _graph().items():
        src = _serve_part(module)
        if src is None:
            continue
        for target in targets:
            dst = _serve_part(target)
            if dst is not None and dst != src and dst not in SERVE_ALLOWED[src]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def _model_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "model" else None


def test_model_subpackages_import_only_downwards() -> None:
    bad = []
    for module, targets in _graph().items():
        src = _model_part(module)
        if src is None:
            continue
        assert src in MODEL_ALLOWED, f"{module}: a new part of model/ needs a row in MODEL_ALLOWED"
        for target in targets:
            dst = _model_part(target)
            if dst is not None and dst != src and dst not in MODEL_ALLOWED[src]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def test_the_layering_rules_the_issue_names() -> None:
    """Spelled out, so a loosened ALLOWED table cannot quietly undo them."""
    assert "engine" not in ALLOWED["model"]
    assert not {"model", "bench", "serve", "tune", "diagnose"} & ALLOWED["sim"]
    assert not {"model", "bench", "serve"} & ALLOWED["tune"]  # --verify's runs come from cli
    assert not {"engine", "model", "serve", "bench", "sim", "benchlib"} & ALLOWED["core"]
    assert not {"serve", "bench", "sim"} & ALLOWED["engine"]
    assert "bench" not in ALLOWED["serve"] and "sim" not in ALLOWED["serve"]


def test_no_import_cycles_between_modules() -> None:
    """Module-level cycles (serve's app and its routes once imported each other)."""
    graph = _graph()
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycle = stack[stack.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            # A package's __init__ re-exporting its children is not a cycle of substance.
            if not node.startswith(target + ".") and not target.startswith(node + "."):
                visit(target, stack + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
