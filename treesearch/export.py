"""Tree exporters for servers: the official Medusa Python list, TensorRT-LLM, vLLM.

* ``python``: a line for the official ``medusa_choices.py``.
* ``trtllm``: TensorRT-LLM's ``--medusa_choices`` argument (``examples/medusa``; the engine reads the
  string with ``ast.literal_eval``).
* ``trtllm-config``: the LLM API's speculative configuration (``MedusaDecodingConfig`` in
  ``tensorrt_llm/llmapi/llm_args.py``: ``decoding_type``, ``max_draft_len``, ``num_medusa_heads``,
  ``medusa_choices``) as JSON, which is also YAML: ``trtllm-serve --extra_llm_api_options FILE``.
* ``vllm``: vLLM's ``--speculative-config``. vLLM's Medusa proposer drafts the heads' top-1 chain
  (``vllm/model_executor/models/medusa.py``: "only supports generating proposals from top-1 tokens");
  a tree is exported as its own top-1 chain, and the exporter says so.
* ``json``: the bare list of rank paths.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from .targets import TRTLLM_MAX_DRAFT_LEN
from .tree import Tree, TreeError

FORMATS = ("python", "trtllm", "trtllm-config", "vllm", "json")


def to_python(tree: Tree, name: str | None = None) -> str:
    """A line for the official ``medusa_choices.py``: ``name = [[0], [0, 0], ...]``."""
    var = (name or tree.name).replace(":", "_").replace("-", "_").replace(".", "_")
    if not var.isidentifier():
        var = "medusa_choices"
    return f"{var} = {tree.as_lists()}"


def check_trtllm(tree: Tree, num_heads: int | None = None, max_draft_len: int = TRTLLM_MAX_DRAFT_LEN) -> None:
    """Refuse, with one line, a tree the engine would reject: more nodes than its draft limit, or
    deeper than the heads it has."""
    if len(tree.paths) > max_draft_len:
        raise TreeError(f"tree '{tree.name}' has {len(tree.paths)} draft nodes; the TensorRT-LLM engine verifies at "
                        f"most max_draft_len={max_draft_len} (build with a larger --max_draft_len or search with "
                        f"--budget {max_draft_len})")
    if num_heads is not None and tree.depth > num_heads:
        raise TreeError(f"tree '{tree.name}' is {tree.depth} levels deep; the engine has {num_heads} Medusa heads")


def to_trtllm(tree: Tree, max_draft_len: int = TRTLLM_MAX_DRAFT_LEN) -> str:
    """TensorRT-LLM's ``--medusa_choices`` argument (a list-of-lists string)."""
    check_trtllm(tree, max_draft_len=max_draft_len)
    return f'--medusa_choices="{tree.as_lists()}"'


def to_trtllm_config(tree: Tree, num_heads: int | None = None, max_draft_len: int = TRTLLM_MAX_DRAFT_LEN) -> str:
    """``{"speculative_config": MedusaDecodingConfig fields}`` for the LLM API and ``trtllm-serve``:
    ``max_draft_len`` is the draft tokens a step verifies (the tree's nodes), ``num_medusa_heads`` the heads in
    the checkpoint (its loader reads that many heads), not the tree's depth."""
    if num_heads is None:
        raise TreeError("TensorRT-LLM's num_medusa_heads is the heads checkpoint's head count, not the tree's depth: "
                        "pass --num-heads (or export a search's tree.json with --target trtllm)")
    check_trtllm(tree, num_heads, max_draft_len)
    spec = {"decoding_type": "Medusa", "max_draft_len": len(tree.paths), "num_medusa_heads": num_heads,
            "medusa_choices": tree.as_lists()}
    return json.dumps({"speculative_config": spec}, indent=1)


def top1_chain_depth(tree: Tree) -> int:
    """How deep the tree's rank-0 chain [0], [0, 0], ... goes."""
    paths, depth = set(tree.paths), 0
    while (0,) * (depth + 1) in paths:
        depth += 1
    return depth


def to_vllm(tree: Tree, model: str | None = None, warn: Callable[[str], None] | None = None) -> str:
    """vLLM's ``--speculative-config`` for its Medusa proposer: the tree's top-1 chain, one token per head."""
    depth = top1_chain_depth(tree)
    if depth == 0:
        raise TreeError(f"tree '{tree.name}' has no rank-0 chain ([0], [0, 0], ...); vLLM's Medusa drafts only "
                        "the heads' top-1 tokens")
    if depth != len(tree.paths):
        (warn or (lambda m: print(m, file=sys.stderr)))(
            f"vLLM's Medusa drafts the heads' top-1 chain only: exporting tree '{tree.name}' "
            f"({len(tree.paths)} nodes) as its chain of {depth}")
    spec = {"method": "medusa", "num_speculative_tokens": depth}
    if model is not None:
        spec["model"] = model
    return json.dumps(spec)


def export_tree(tree: Tree, fmt: str, num_heads: int | None = None, max_draft_len: int = TRTLLM_MAX_DRAFT_LEN,
                model: str | None = None) -> str:
    if fmt == "python":
        return to_python(tree)
    if fmt == "trtllm":
        return to_trtllm(tree, max_draft_len)
    if fmt == "trtllm-config":
        return to_trtllm_config(tree, num_heads, max_draft_len)
    if fmt == "vllm":
        return to_vllm(tree, model)
    if fmt == "json":
        return json.dumps(tree.as_lists())
    raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
