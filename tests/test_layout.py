"""The layering the design card promises, checked on the source: bench -> medusa_runtime -> treesearch, nothing
upward; no import cycles among the project's modules (module-level or inside functions); treesearch runs
without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "medusa_runtime", "treesearch")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules a module imports anywhere in its source (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # an imported name, not a module: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# The rooms of each package, lowest first: a module may import its own room and rooms of a lower rank, never one
# of the same rank or above. A room is a sub-package or a top-level module; treesearch is one room below both.
RANKS = {
    "treesearch": 0,
    # medusa_runtime: where the data goes, prompt -> engine -> heads -> tree -> verify -> acceptance -> commit
    "medusa_runtime": 1, "medusa_runtime.paths": 1, "medusa_runtime.prompts": 1,
    "medusa_runtime.kernels": 2,
    "medusa_runtime.model": 3,
    "medusa_runtime.engines": 4, "medusa_runtime.heads": 4, "medusa_runtime.tree": 4,
    "medusa_runtime.decoding": 5,
    "medusa_runtime.measure": 6,
    "medusa_runtime.training": 7, "medusa_runtime.server": 7,
    # bench: replay -> judge, engines -> report -> stages -> commands -> the two entry points
    "bench": 10, "bench.replay": 10,
    "bench.judge": 11, "bench.engines": 11,
    "bench.load": 12,
    "bench.report": 12,
    "bench.stages": 13,
    "bench.commands": 14,
    "bench.cli": 15, "bench.pipeline": 15,
    "bench.cli_reference": 16,
}


def _room(module: str) -> str:
    """The room of a module: its longest prefix in RANKS."""
    parts = module.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in RANKS)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def test_no_import_cycles_and_nothing_imports_upward():
    graph = _graph()
    assert graph["bench.pipeline"] >= {"bench.stages.jobs", "bench.stages.cache"}  # the walk sees imports at all
    assert "bench.engines.stage" in graph["bench.pipeline"]  # and those inside functions
    assert _cycles(graph) == []
    unranked = sorted(m for m in graph if _room(m) not in RANKS)
    assert unranked == []
    upward = sorted((m, d) for m, deps in graph.items() for d in deps
                    if _room(d) != _room(m) and RANKS[_room(d)] >= RANKS[_room(m)])
    assert upward == []


def test_the_rooms_form_no_cycle():
    rooms: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        rooms.setdefault(_room(m), set()).update(_room(d) for d in deps if _room(d) != _room(m))
    assert _cycles({r: rooms.get(r, set()) for r in RANKS}) == []


def test_the_pipeline_calls_stages_not_commands():
    """The pipeline builds jobs and calls the stages; of the command layer it reads only the flags' vocabulary
    (its own parser speaks it)."""
    commands = sorted(d for d in _graph()["bench.pipeline"] if _room(d) == "bench.commands" and d != "bench.commands")
    assert commands == ["bench.commands.flags"]


def test_the_top_of_each_package_is_small():
    """medusa_runtime keeps the model loader, prompts, paths and the server at its top; bench its two entry points
    and the CLI reference; everything else lives in a room that names what it does."""
    top = {pkg: sorted(p.stem for p in (ROOT / pkg).glob("*.py") if p.name != "__init__.py")
           for pkg in ("medusa_runtime", "bench")}
    assert len(top["medusa_runtime"]) <= 6 and len(top["bench"]) <= 10, top


def _private_in(name: str, source: str) -> list[str]:
    """``from project.module import _name`` (or an import of a ``_module``) in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            private += [p for p in node.module.split(".") if p.startswith("_") and not p.startswith("__")]
            found += [f"{name}: from {node.module} import {p}" for p in private]
    return found


def _inner_in(name: str, source: str) -> list[tuple[str, str, str]]:
    """Every import statement inside a function body: (module, statement, the comment on its first line)."""
    found, lines = [], source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found.append((name, ast.unparse(sub), lines[sub.lineno - 1].partition("#")[2].strip()))
    return found


def _private_imports() -> list[str]:
    return [f for name, path in _modules().items() for f in _private_in(name, path.read_text())]


def _function_imports() -> list[tuple[str, str, str]]:
    return [f for name, path in _modules().items() for f in _inner_in(name, path.read_text())]


def test_no_module_imports_another_modules_private_name():
    assert _private_imports() == []


def test_imports_inside_functions_defer_a_heavy_dependency_and_say_which():
    """An import stays in a function only to defer a heavy or optional dependency, with a comment naming it."""
    inner = _function_imports()
    assert len(inner) <= 60, len(inner)
    assert [(m, stmt) for m, stmt, why in inner if not why] == []


def test_no_function_is_over_80_lines():
    files = [*_modules().values(), *sorted((ROOT / "tests").glob("*.py")), ROOT / "noxfile.py"]
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}" for path in files
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []


def test_the_checks_see_what_they_check():
    """Each walk above finds what it looks for in a module made for it."""
    src = ("from bench.x import _hidden, shown\n"
           "from bench._inner import y\n"
           "import json\n"
           "def f():\n    import torch  # torch: heavy\n    from bench.x import z\n")
    assert _private_in("m", src) == ["m: from bench.x import _hidden", "m: from bench._inner import _inner"]
    assert _inner_in("m", src) == [("m", "import torch", "torch: heavy"), ("m", "from bench.x import z", "")]
    assert _room("medusa_runtime.engines.lean") == "medusa_runtime.engines" and _room("bench.cli") == "bench.cli"


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_treesearch_never_imports_torch():
    names = sorted(m for m in _modules() if m.split(".")[0] == "treesearch")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in names)
            + "bad = [m for m in ('torch', 'transformers', 'medusa_runtime', 'bench') if m in sys.modules]\n"
            + "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_loading_the_shipped_heads_imports_nothing_of_training():
    """Inference loads heads (the Medusa-2 adapter merged into the base included) without importing the training
    stack: checked in a fresh interpreter, on sys.modules."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import medusa_runtime.heads.medusa\n"
            "from medusa_runtime.model import load_model\n"
            "from medusa_runtime.heads.medusa import resolve_heads\n"
            "from medusa_runtime.heads.adapter import apply_heads_adapter\n"
            "from medusa_runtime.heads.medusa import shipped_heads_dir\n"
            "loaded = load_model('default', 'float32', 'cpu', log=lambda m: None)\n"
            "resolve_heads('default', loaded.hidden_size, loaded.vocab_size)\n"
            "apply_heads_adapter(loaded, shipped_heads_dir('default'), log=lambda m: None)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('medusa_runtime'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    training = {m for m in loaded if m == "medusa_runtime.training" or m.startswith("medusa_runtime.training.")}
    assert "medusa_runtime.heads.adapter" in loaded and "medusa_runtime.heads.medusa" in loaded and not training, training


def test_inference_imports_nothing_of_the_training_package():
    """No module of medusa_runtime outside training/ imports it (read from their import statements)."""
    import ast

    runtime = ROOT / "medusa_runtime"
    offenders = []
    for path in sorted(runtime.rglob("*.py")):
        if "training" in path.relative_to(runtime).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [("." * node.level) + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if "training" in n.split(".")]
    assert (runtime / "training" / "train.py").is_file() and offenders == []


def test_readme_is_a_short_users_guide_with_the_two_commands_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8 * 1024
    first = readme[:readme.index("## What you get")]
    for line in ("pip install nox", "nox -s bench", "nox -s tests", "pip install -e ."):
        assert line in first, line


def test_the_runtimes_public_names_load_lazily():
    """``import medusa_runtime`` loads no torch; each public name then comes from the module that defines it."""
    code = ("import sys, medusa_runtime\n"
            "assert 'torch' not in sys.modules\n"
            "for name, module in medusa_runtime.PUBLIC.items():\n"
            "    obj = getattr(medusa_runtime, name)\n"
            "    assert obj is getattr(sys.modules[module], name), name\n"
            "print(len(medusa_runtime.PUBLIC))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 10


def test_the_pipelines_search_workers_load_no_torch():
    """The pipeline runs its searches side by side in spawned processes, which import the pipeline module (as their
    main) and the search stage: neither may load torch, transformers or a model (each worker would pay for it)."""
    code = ("import sys, bench.pipeline\n"
            "from bench.stages.jobs import import_function\n"
            "stage = import_function(bench.pipeline.STAGES[bench.pipeline.SearchJob])\n"
            "assert stage.__module__ == 'bench.stages.search', stage.__module__\n"
            "print(' '.join(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
