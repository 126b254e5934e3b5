"""Where a configuration is deployed, and what each place can run.

A target is this runtime (``own``) or a serving engine. The search ranges only over what its target runs,
and an export refuses whatever the target cannot run instead of dropping it:

* ``vllm``: vLLM's Medusa proposer drafts the heads' top-1 *chain*, one token per head
  (``vllm/model_executor/models/medusa.py``); no prompt lookup beside it, no gate, heads that read only the
  hidden state, over the whole vocabulary.
* ``trtllm``: TensorRT-LLM verifies a ``medusa_choices`` tree of at most ``max_draft_len`` draft tokens
  (``len(medusa_choices) <= max_draft_tokens`` in ``tensorrt_llm/runtime/generation.py``, 63 in its
  examples and ``tensorrt_llm/models/medusa/config.py``), no deeper than its ``num_medusa_heads``; no lookup,
  no gate, unconditioned heads.
* ``tgi``: text-generation-inference speculates the heads' top-1 chain (``--speculate`` tokens); no lookup,
  no gate, unconditioned heads.
* ``own``: everything this runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .stats import StatsError
from .tree import TreeError, read_json

# TensorRT-LLM's default engine limit on the draft tokens one step verifies (MedusaConfig.max_draft_len)
TRTLLM_MAX_DRAFT_LEN = 63


@dataclass(frozen=True)
class Target:
    name: str
    engine: str  # as people write it
    chain_only: bool  # drafts the heads' top-1 chain, never a tree
    lookup: bool  # runs a prompt-lookup chain beside the heads
    gates: bool  # runs a confidence gate on the tree's levels
    conditioned_heads: bool  # runs heads that read the step's root (and parent) tokens
    max_nodes: int | None = None  # draft tokens one step may verify (None: no limit of its own)
    report_engine: str | None = None  # its name in a report.json of the engines session, where that measures it


TARGETS: dict[str, Target] = {
    "own": Target("own", "this runtime", chain_only=False, lookup=True, gates=True, conditioned_heads=True),
    "vllm": Target("vllm", "vLLM", chain_only=True, lookup=False, gates=False, conditioned_heads=False,
                   report_engine="vllm"),
    "trtllm": Target("trtllm", "TensorRT-LLM", chain_only=False, lookup=False, gates=False, conditioned_heads=False,
                     max_nodes=TRTLLM_MAX_DRAFT_LEN),
    "tgi": Target("tgi", "text-generation-inference", chain_only=True, lookup=False, gates=False,
                  conditioned_heads=False),
}


@dataclass(frozen=True)
class EngineCosts:
    """What one speculative step of an engine costs in its own plain steps, per chain length, as the engines
    session measured it (report.json's ``step_cost_vs_engine_plain`` of its Medusa rows: tau over the measured
    speed-up). A chain of k then runs ``tau_k / cost_k`` times the engine's plain decoding."""

    target: str
    by_draft_tokens: dict[int, float]
    source: str

    def describe(self) -> str:
        costs = ", ".join(f"chain of {k}: {c:.3f}" for k, c in sorted(self.by_draft_tokens.items()))
        return f"{TARGETS[self.target].engine}'s measured step costs in its plain steps ({self.source}: {costs})"


def load_engine_costs(path: str, target: Target) -> EngineCosts:
    """The step costs of ``target`` + Medusa from a report.json of the engines session (``nox -s engines``)."""
    if target.report_engine is None:
        raise StatsError(f"no engines session measures {target.engine} here: its step costs cannot be read")
    obj = read_json(path, StatsError, "engines report")
    configs = (obj.get("configs") or []) if isinstance(obj, dict) else []
    rows = [c for c in configs if c.get("engine") == target.report_engine and c.get("speculative") == "medusa"
            and c.get("step_cost_vs_engine_plain") and c.get("draft_tokens")]
    if not rows:
        raise StatsError(f"{path} holds no measured step cost of {target.engine} + Medusa (a report.json of "
                         "nox -s engines, written by this version)")
    return EngineCosts(target.name, {int(c["draft_tokens"]): float(c["step_cost_vs_engine_plain"]) for c in rows},
                       str(path))


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise TreeError(f"unknown target {name!r}; use one of {', '.join(TARGETS)}")
    return TARGETS[name]


def is_chain(paths: list[list[int]] | tuple) -> bool:
    """Whether rank paths are exactly the top-1 chain [0], [0, 0], ... of their depth."""
    want = {(0,) * d for d in range(1, len(paths) + 1)}
    return {tuple(p) for p in paths} == want


def heads_conditioning(config: dict[str, Any]) -> str:
    """'path', 'root' or 'none': what a heads folder's config.json says its first block reads."""
    if config.get("medusa_path_conditioned"):
        return "path"
    return "root" if config.get("medusa_root_conditioned") else "none"


def refusals(target: Target, medusa_choices: list[list[int]] | None, lookup: int = 0, gate: float = 0.0,
             conditioning: str = "none", num_heads: int | None = None) -> list[str]:
    """What of a configuration ``target`` cannot run, one phrase each (empty: it runs all of it)."""
    out = []
    if lookup and not target.lookup:
        out.append(f"a prompt-lookup chain of {lookup} tokens")
    if gate and not target.gates:
        out.append(f"a confidence gate ({gate:g})")
    if conditioning != "none" and not target.conditioned_heads:
        out.append(f"{conditioning}-conditioned heads (their first block reads the step's root"
                   f"{' and parent' if conditioning == 'path' else ''} token)")
    if medusa_choices:
        depth = max(len(p) for p in medusa_choices)
        if target.chain_only and not is_chain(medusa_choices):
            out.append(f"a tree of {len(medusa_choices)} nodes (it drafts the heads' top-1 chain only)")
        if target.max_nodes is not None and len(medusa_choices) > target.max_nodes:
            out.append(f"{len(medusa_choices)} draft nodes (its engines verify at most {target.max_nodes})")
        if num_heads is not None and depth > num_heads:
            out.append(f"a tree {depth} levels deep on {num_heads} heads")
    return out


def refusal_line(target: Target, reasons: list[str]) -> str:
    return f"{target.engine} cannot run {'; '.join(reasons)}: search for it with --target {target.name}"
