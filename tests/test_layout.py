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


def test_no_import_cycles_and_nothing_imports_upward():
    mods = _modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert graph["bench.pipeline"] >= {"bench.jobs", "bench.stages"}  # the walk sees imports at all
    assert "bench.commands.measure" in graph["bench.pipeline"]  # and those inside functions
    assert _cycles(graph) == []
    rank = {"treesearch": 0, "medusa_runtime": 1, "bench": 2}
    upward = [(m, d) for m, deps in graph.items() for d in deps if rank[d.split(".")[0]] > rank[m.split(".")[0]]]
    assert upward == []


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
            "import medusa_runtime.heads\n"
            "from medusa_runtime.model import load_model\n"
            "from medusa_runtime.heads import resolve_heads\n"
            "from medusa_runtime.adapter import apply_heads_adapter\n"
            "from medusa_runtime.heads import shipped_heads_dir\n"
            "loaded = load_model('default', 'float32', 'cpu', log=lambda m: None)\n"
            "resolve_heads('default', loaded.hidden_size, loaded.vocab_size)\n"
            "apply_heads_adapter(loaded, shipped_heads_dir('default'), log=lambda m: None)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('medusa_runtime'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    training = {m for m in loaded if m == "medusa_runtime.training" or m.startswith("medusa_runtime.training.")}
    assert "medusa_runtime.adapter" in loaded and "medusa_runtime.heads" in loaded and not training, training


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
