"""Tree exporters for servers: the official Medusa Python list, TensorRT-LLM, vLLM."""

from __future__ import annotations

import json

from .tree import Tree

FORMATS = ("python", "trtllm", "vllm", "json")


def to_python(tree: Tree, name: str | None = None) -> str:
    """A line for the official ``medusa_choices.py``: ``name = [[0], [0, 0], ...]``."""
    var = (name or tree.name).replace(":", "_").replace("-", "_").replace(".", "_")
    if not var.isidentifier():
        var = "medusa_choices"
    return f"{var} = {tree.as_lists()}"


def to_trtllm(tree: Tree) -> str:
    """TensorRT-LLM's ``--medusa_choices`` argument (a list-of-lists string)."""
    return f'--medusa_choices="{tree.as_lists()}"'


def to_vllm(tree: Tree) -> str:
    """vLLM's speculative config: ``speculative_token_tree`` is a string of rank-path tuples in
    breadth-first (official) order, and ``num_speculative_tokens`` its number of nodes."""
    tuples = "[" + ", ".join("(" + ", ".join(map(str, p)) + ("," if len(p) == 1 else "") + ")"
                             for p in tree.paths) + "]"
    return json.dumps({"method": "medusa", "num_speculative_tokens": len(tree.paths),
                       "speculative_token_tree": tuples})


def export_tree(tree: Tree, fmt: str) -> str:
    if fmt == "python":
        return to_python(tree)
    if fmt == "trtllm":
        return to_trtllm(tree)
    if fmt == "vllm":
        return to_vllm(tree)
    if fmt == "json":
        return json.dumps(tree.as_lists())
    raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
