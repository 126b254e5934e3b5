"""Candidate trees as data: rank paths in the official Medusa order, validated, JSON in and out.

A tree is a set of *rank paths*. The path ``(r1, r2, ..., rd)`` is a node at depth ``d`` whose
token is the rank-``rd`` guess of Medusa head ``d-1``, hanging below the node ``(r1, ..., r(d-1))``.
The root (depth 0, the base model's own next token) is implicit and never listed.

This module is pure Python: the runtime turns a :class:`Tree` into tensors, the search builds and
scores trees without torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from .fsutil import atomic_file

TREE_SCHEMA = "medusa-tree/2"  # /2 added the batch-size schedule; /1 files read as they are
READABLE_SCHEMAS = ("medusa-tree/1", TREE_SCHEMA)

Path_ = tuple[int, ...]


class TreeError(ValueError):
    """A tree that cannot be used, with a one-line reason."""


@dataclass(frozen=True)
class Tree:
    """An immutable candidate tree: rank paths sorted by (length, ranks), the official order."""

    paths: tuple[Path_, ...]  # every non-root node, official order
    name: str = "custom"  # preset name or file the tree came from
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # provenance

    @property
    def num_nodes(self) -> int:
        """Nodes verified per step, the root included."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """Deepest level below the root (= number of Medusa heads the tree needs)."""
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        """Largest rank used at any depth (the heads' top-k must exceed it)."""
        return max((p[-1] for p in self.paths), default=-1)

    def as_lists(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def official_order(paths: Iterable[Sequence[int]]) -> tuple[Path_, ...]:
    """Sort paths as the official Medusa code does: by length, then lexicographically."""
    return tuple(sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (len(p), p)))


def validate_paths(paths: Sequence[Sequence[int]]) -> tuple[Path_, ...]:
    """Check structure and return the paths in official order; raise TreeError on any defect."""
    if not isinstance(paths, (list, tuple)):
        raise TreeError(f"a tree must be a list of rank paths, got {type(paths).__name__}")
    if len(paths) == 0:
        raise TreeError("the tree is empty: give at least one rank path such as [0]")
    seen: set[Path_] = set()
    for raw in paths:
        if not isinstance(raw, (list, tuple)) or len(raw) == 0:
            raise TreeError(f"each rank path must be a non-empty list of ranks, got {raw!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
            raise TreeError(f"ranks must be integers, got {list(raw)!r}")
        path = tuple(raw)
        if any(r < 0 for r in path):
            raise TreeError(f"ranks must be >= 0, got {list(path)}")
        if path in seen:
            raise TreeError(f"duplicate path {list(path)}")
        seen.add(path)
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(f"path {list(path)} has no parent {list(path[:-1])} in the tree")
    return official_order(seen)


def check_fits(tree: Tree, num_heads: int, topk: int) -> None:
    """Refuse a tree that asks for more heads or deeper ranks than the decoder provides."""
    if tree.depth > num_heads:
        raise TreeError(
            f"tree '{tree.name}' is {tree.depth} levels deep but only {num_heads} Medusa heads are loaded"
        )
    if tree.max_rank >= topk:
        raise TreeError(f"tree '{tree.name}' uses rank {tree.max_rank} but heads propose only top-{topk}")


def make_tree(paths: Sequence[Sequence[int]], name: str = "custom", **meta: Any) -> Tree:
    return Tree(paths=validate_paths(paths), name=name, meta=dict(meta))


def chain(depth: int) -> Tree:
    """A single path of rank-0 guesses, ``depth`` levels deep."""
    if depth < 1:
        raise TreeError(f"a chain needs depth >= 1, got {depth}")
    return make_tree([[0] * d for d in range(1, depth + 1)], name=f"chain:{depth}")


@cache
def _official_presets() -> dict[str, tuple[Path_, ...]]:
    # Official trees of the Medusa project (Apache-2.0, see data/LICENSE-medusa), carried as data.
    text = resources.files("treesearch").joinpath("data/medusa_choices.json").read_text()
    return {name: validate_paths(paths) for name, paths in json.loads(text).items()}


def preset_names() -> list[str]:
    return sorted(_official_presets()) + ["chain:N"]


def tree_from_json(obj: Any, name: str = "custom") -> Tree:
    """Accept ``{"schema": "medusa-tree/2", "medusa_choices": [...]}`` (or /1, or a bare list of paths)."""
    if isinstance(obj, list):
        return make_tree(obj, name=name)
    if not isinstance(obj, dict):
        raise TreeError(f"tree JSON must be an object with 'medusa_choices', got {type(obj).__name__}")
    schema = obj.get("schema")
    if schema not in READABLE_SCHEMAS:
        raise TreeError(f"tree JSON has schema {schema!r}, expected {TREE_SCHEMA!r}")
    if "medusa_choices" not in obj:
        raise TreeError("tree JSON has no 'medusa_choices'")
    derived = ("schema", "medusa_choices", "name", "num_nodes", "depth")  # recomputed, not carried
    meta = {k: v for k, v in obj.items() if k not in derived}
    return make_tree(obj["medusa_choices"], name=str(obj.get("name", name)), **meta)


def load_tree(spec: str | Tree | Sequence[Sequence[int]]) -> Tree:
    """Resolve a preset name, ``chain:N``, a tree JSON file, or a list of paths into a Tree."""
    if isinstance(spec, Tree):
        return spec
    if not isinstance(spec, str):
        return make_tree(spec)
    presets = _official_presets()
    if spec in presets:
        return Tree(paths=presets[spec], name=spec, meta={"source": "official Medusa (Apache-2.0)"})
    if spec.startswith("chain:"):
        try:
            depth = int(spec.split(":", 1)[1])
        except ValueError:
            raise TreeError(f"bad chain spec {spec!r}: use chain:N with an integer N") from None
        return chain(depth)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise TreeError(f"tree file not found: {spec}")
        return tree_from_json(read_json(path, TreeError, "tree file"), name=path.stem)
    raise TreeError(f"unknown tree {spec!r}: use one of {', '.join(preset_names())}, or a tree JSON file")


def tree_to_json(tree: Tree, **provenance: Any) -> dict[str, Any]:
    """The versioned file form of a tree; provenance keys are stored beside the paths."""
    return {"schema": TREE_SCHEMA, "name": tree.name, "num_nodes": tree.num_nodes, "depth": tree.depth,
            "medusa_choices": tree.as_lists(), **tree.meta, **provenance}


def save_tree(tree: Tree, path: str | os.PathLike[str], **provenance: Any) -> Path:
    """Write tree JSON atomically (temp file + rename)."""
    return write_json_atomic(path, tree_to_json(tree, **provenance))


def read_json(path: str | os.PathLike[str], error: type[ValueError], what: str) -> Any:
    """Parse a JSON file or raise ``error`` with a one-line reason (missing file, bad JSON)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return json.loads(p.read_bytes())
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """``obj`` as indented JSON, swapped in whole (see ``fsutil.atomic_file``)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
    return Path(path)
