"""Replay whole decoding configurations on calibration rollouts: heads tree, lookup chain and gate jointly.

A *configuration* is what the runtime can run with greedy acceptance (``medusa_runtime.decoding.decode``):
no heads (plain decoding) or a heads tree, a prompt-lookup chain of L draft tokens (0: none), and a
confidence gate G on the tree's levels (0: off). Along a greedy rollout y_1 .. y_M of a prompt, the
decoder's steps are determined by the tokens alone, so the replay walks them exactly::

    t = 0                          # the step's last accepted token is y_t (y_0: the prompt's last), root y_{t+1}
    while t < M - 1:
        d_heads  = longest prefix of ranks[t] that is a path of the tree, cut at the gate's depth
        d_lookup = leading tokens of the n-gram draft (prompt + y_1..y_t, root y_{t+1}) equal to y_{t+2}..
        step commits 1 + max(d_heads, d_lookup) tokens; t += that

Every step also knows what it verified (the tree's nodes, cut by the gate, plus the draft's tokens) and
its context (prompt + t cached positions), so the latency profile prices it: a generate's predicted
time is prefill(prompt) + the sum of its steps (``treesearch.cost``). The drafts come from the same
``NgramIndex`` the decoder uses; the heads' ranks and gate probabilities were measured by calibration
feeding the heads the rollout's own tokens as roots and parents, which is what a tree node sees
whenever its parent is accepted. In float32 the replay therefore equals the decoder step for step
(tested); in bfloat16 the decoder's tree rows round differently from the calibration forward here
and there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cost import LatencyProfile
from .ngram import LookupConfig, NgramIndex
from .stats import AcceptanceStats, RolloutText, StatsError, accepted_depth, bootstrap_ratio
from .tree import Tree, make_tree


@dataclass(frozen=True)
class Decoding:
    """One configuration of the runtime under greedy acceptance."""

    tree: Tree | None = None  # the heads' candidate tree; None: no heads (plain decoding)
    lookup: int = 0  # prompt-lookup draft tokens per step (0: no lookup chain)
    gate: float = 0.0  # confidence gate on the tree's levels (see DecodeConfig.gate; 0: off)

    def __post_init__(self) -> None:
        if self.lookup < 0:
            raise StatsError(f"lookup tokens must be >= 0, got {self.lookup}")
        if not 0.0 <= self.gate <= 1.0:
            raise StatsError(f"gate must be within [0, 1], got {self.gate}")
        if self.gate > 0 and self.tree is None:
            raise StatsError("a gate needs a heads tree")
        if self.gate > 0 and any((0,) * d not in set(self.tree.paths) for d in range(1, self.tree.depth + 1)):
            raise StatsError(f"a gate reads the heads' top-1 chain: tree '{self.tree.name}' must hold [0], [0, 0], ... "
                             "to its depth")

    @property
    def uses_heads(self) -> bool:
        return self.tree is not None

    @property
    def label(self) -> str:
        """A readable name: ``plain``, ``plain +lookup4``, ``tree mc_sim_7b_63 +lookup4 gate0.2``."""
        parts = ["plain" if self.tree is None else f"tree {self.tree.name}"]
        if self.lookup:
            parts.append(f"+lookup{self.lookup}")
        if self.gate:
            parts.append(f"gate{self.gate:g}")
        return " ".join(parts)


def configuration_json(dec: Decoding) -> dict[str, Any]:
    """A configuration as tree.json writes it (its ``configuration``, each schedule range's)."""
    return {"config": dec.label, "uses_heads": dec.tree is not None,
            "medusa_choices": dec.tree.as_lists() if dec.tree is not None else None,
            "tree_nodes": len(dec.tree.paths) if dec.tree is not None else None,
            "lookup": dec.lookup, "gate": dec.gate}


def decoding_of_json(conf: dict[str, Any]) -> Decoding:
    """The configuration ``configuration_json`` wrote."""
    choices = conf.get("medusa_choices")
    tree = make_tree(choices, name=str(conf.get("config") or "custom")) if choices else None
    return Decoding(tree, int(conf.get("lookup") or 0), float(conf.get("gate") or 0.0))


@dataclass(frozen=True)
class RolloutReplay:
    """One rollout replayed under one configuration."""

    id: str
    accept_lengths: tuple[int, ...]  # tokens committed per step
    tokens: int  # new tokens of the generate (the rollout's length)
    time_ms: float  # predicted: prefill + every step (0 without a latency profile)
    verified: tuple[int, ...] = ()  # [steps] nodes each step verified (root included)
    contexts: tuple[int, ...] = ()  # [steps] cached positions before each step
    prompt_tokens: int = 0


@dataclass(frozen=True)
class ReplayResult:
    decoding: Decoding
    rollouts: tuple[RolloutReplay, ...]

    @property
    def steps(self) -> int:
        return sum(len(r.accept_lengths) for r in self.rollouts)

    @property
    def tau(self) -> float:
        """Tokens committed per step, over all rollouts (as the runtime's accept lengths average)."""
        return sum(sum(r.accept_lengths) for r in self.rollouts) / max(1, self.steps)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rollouts)

    @property
    def time_ms(self) -> float:
        return sum(r.time_ms for r in self.rollouts)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.time_ms if self.time_ms > 0 else float("nan")

    def tau_interval(self, level: float = 0.95) -> tuple[float, float]:
        """Bootstrap interval of tau over the rollouts, resampled whole: how far another sample of prompts
        like these could move it."""
        rows = [r for r in self.rollouts if r.accept_lengths]
        return bootstrap_ratio([sum(r.accept_lengths) for r in rows], [len(r.accept_lengths) for r in rows], level)


def _level_nodes(tree: Tree) -> list[int]:
    """[depth + 1]: nodes (root included) of the tree cut below each level d = 0 .. depth."""
    by_depth = np.bincount([len(p) for p in tree.paths], minlength=tree.depth + 1)
    return [1] + (1 + np.cumsum(by_depth[1:])).tolist()


def gated_depth(gate_probs: Sequence[float], depth: int, gate: float) -> int:
    """Levels whose top-1 chain probability (the cumulative product of the heads' top-1 probabilities, in
    float32) reaches the gate; the decoder calls it on the probabilities of its step, the replay on those
    calibration stored. Probabilities are at most 1, so the product never grows and a prefix of the levels
    passes. Scalar float32 steps: a decode step's 1-4 levels cost microseconds, not a vectorised call's tens."""
    threshold, chain, passed = np.float32(gate), np.float32(1.0), 0
    for p in gate_probs[:depth]:
        chain = chain * np.float32(p)  # float32 x float32: rounded to float32
        if chain < threshold:
            break
        passed += 1
    return passed


def replay_rollout(dec: Decoding, text: RolloutText, ranks: Sequence[Sequence[int]],
                   latency: LatencyProfile | None = None, lookup_cfg: LookupConfig | None = None) -> RolloutReplay:
    """Walk the decoder's steps along one rollout (see the module doc)."""
    y = text.output  # y[i] is y_{i+1}
    n = text.positions
    if len(ranks) != n:
        raise StatsError(f"rollout {text.id!r}: {len(ranks)} rank vectors for {n} positions")
    if dec.gate > 0 and text.gate is None:
        raise StatsError("these statistics carry no gate probabilities: calibrate again to replay a gate")
    paths = frozenset(dec.tree.paths) if dec.tree is not None else frozenset()
    depth = dec.tree.depth if dec.tree is not None else 0
    level_nodes = _level_nodes(dec.tree) if dec.tree is not None else [1]
    heads_ms = latency.heads_time(dec.tree) if latency is not None and dec.tree is not None else 0.0
    look = lookup_cfg or LookupConfig()
    index = NgramIndex(LookupConfig(dec.lookup, look.max_ngram, look.min_ngram), list(text.prompt)) \
        if dec.lookup else None
    lengths: list[int] = []
    verified_nodes: list[int] = []
    time_ms = latency.prefill(len(text.prompt)) if latency is not None else 0.0
    t = 0
    while t < n:
        cut = depth if dec.gate <= 0 else gated_depth(text.gate[t], depth, dec.gate)
        d_heads = min(accepted_depth(paths, ranks[t]), cut) if depth else 0
        draft = index.draft(y[t]) if index is not None else []
        d_look = 0
        while d_look < len(draft) and t + 1 + d_look < len(y) and draft[d_look] == y[t + 1 + d_look]:
            d_look += 1
        step = 1 + max(d_heads, d_look)
        verified = level_nodes[cut] + len(draft)
        verified_nodes.append(verified)
        if latency is not None:
            time_ms += latency.step_ms(verified, len(text.prompt) + t, heads_ms=heads_ms, lookup=index is not None)
        if index is not None:
            index.extend(list(y[t:t + step]))
        lengths.append(step)
        t += step
    contexts = tuple(len(text.prompt) + t for t in np.cumsum([0] + lengths[:-1]).tolist())
    return RolloutReplay(text.id, tuple(lengths), len(y), time_ms, tuple(verified_nodes), contexts, len(text.prompt))


def replay(dec: Decoding, stats: AcceptanceStats, latency: LatencyProfile | None = None,
           heldout: bool = False) -> ReplayResult:
    """Replay one configuration on every fitting rollout (or the held-out ones) of ``stats``."""
    texts = stats.heldout_texts if heldout else stats.texts
    ranks = stats.heldout if heldout else stats.rollouts
    if len(texts) != len(ranks) or not texts:
        raise StatsError("these statistics carry no rollout tokens: calibrate again to replay configurations")
    if dec.tree is not None and (dec.tree.depth > stats.num_heads or dec.tree.max_rank >= stats.topk):
        raise StatsError(f"tree '{dec.tree.name}' needs {dec.tree.depth} heads and top-{dec.tree.max_rank + 1}; "
                         f"the statistics have {stats.num_heads} heads and top-{stats.topk}")
    return ReplayResult(dec, tuple(replay_rollout(dec, t, r, latency) for t, r in zip(texts, ranks)))


@dataclass(frozen=True)
class Prediction:
    """A configuration's predicted tau and speed over the runtime's plain decoding on the same rollouts."""

    decoding: Decoding
    tau: float
    tokens_per_s: float
    speedup: float  # over plain decoding, predicted on the same rollouts: time(plain) / time(configuration)


def predict_decoding(dec: Decoding, stats: AcceptanceStats, latency: LatencyProfile,
                     plain: ReplayResult | None = None) -> Prediction:
    """tau and speed-up of ``dec`` over plain decoding, both replayed on the fitting rollouts."""
    res = replay(dec, stats, latency)
    base = plain if plain is not None else replay(Decoding(), stats, latency)
    return Prediction(dec, res.tau, res.tokens_per_s, base.time_ms / res.time_ms)
