"""Typical acceptance replayed from calibration rollouts: tau and a quality proxy for any thresholds.

Typical acceptance (Medusa paper) accepts candidate x after a node when the base model's tempered
distribution p there gives it  p(x) > min(epsilon, delta * exp(-H(p))),  and commits the longest
tree path whose nodes all pass (ties: the largest summed log p). Unlike greedy acceptance, the
outcome depends on the thresholds (epsilon = ``posterior_threshold``, delta = ``posterior_alpha``),
so calibration can store what any thresholds need, per greedy rollout position t and head j:

* ``logp[t, j, r]``: log p of head j's rank-r token under the base model at the position it would
  be verified (the rollout's context up to token t+j+1), -inf past the rollout's end;
* ``entropy[q]`` and ``greedy_logp[q]``: H(p) and log p of the base model's own (argmax) token
  at rollout position q.

Replay walks each rollout like the decoder: a step at t accepts the longest passing path and
commits 1 + depth tokens. It evaluates every node in the rollout's context, which is exact while
the accepted tokens equal the rollout's and an approximation after the first accepted token that
differs (the real decoder then continues from a different text). The quality proxy is the mean
*regret* per committed token: log p of the base model's own token minus log p of the accepted
one (0 for greedy decoding; the root token is the base model's own and adds nothing).

The data lives in ``acceptance.json`` under ``"typical"``: per rollout the three arrays as
base64 little-endian float16 (a few hundred kB for a calibration set).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import StatsError
from .tree import Tree, check_fits

SEARCH_TEMPERATURE = 0.7  # the temperature the bench calibrates, profiles and searches typical acceptance at


# typical acceptance's thresholds by default: the Medusa paper's (the runtime, the bench and the CLI read these)
POSTERIOR_THRESHOLD = 0.09  # epsilon: hard ceiling of the threshold
POSTERIOR_ALPHA = 0.3  # delta: scales exp(-entropy)


@dataclass(frozen=True)
class TypicalParams:
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA

    def __post_init__(self) -> None:
        if not (0 < self.posterior_threshold <= 1 and 0 < self.posterior_alpha <= 1):
            raise StatsError(f"typical thresholds must lie in (0, 1], got epsilon={self.posterior_threshold}, "
                             f"delta={self.posterior_alpha}")


@dataclass(frozen=True)
class TypicalSeq:
    """One rollout of M tokens: P = M - 1 step positions."""

    logp: np.ndarray  # [P, K, k] log p of head j's rank-r token at its verify position (-inf: past the end)
    entropy: np.ndarray  # [M] entropy of the base distribution that predicts rollout token q
    greedy_logp: np.ndarray  # [M] log p of the base model's argmax token at q

    def __post_init__(self) -> None:
        p = self.logp.shape[0]
        if self.logp.ndim != 3 or self.entropy.shape != (p + 1,) or self.greedy_logp.shape != (p + 1,):
            raise StatsError(f"typical rollout arrays disagree: logp {self.logp.shape}, entropy "
                             f"{self.entropy.shape}, greedy_logp {self.greedy_logp.shape}")


@dataclass(frozen=True)
class TypicalStats:
    temperature: float  # the base distribution's temperature the arrays were computed at
    rollouts: tuple[TypicalSeq, ...]  # fitting rollouts, same order as the rank rollouts
    heldout: tuple[TypicalSeq, ...] = ()

    @property
    def num_heads(self) -> int:
        return int(self.rollouts[0].logp.shape[1]) if self.rollouts else 0

    @property
    def topk(self) -> int:
        return int(self.rollouts[0].logp.shape[2]) if self.rollouts else 0


@dataclass(frozen=True)
class TypicalResult:
    tau: float  # tokens committed per step
    regret: float  # mean log p(own token) - log p(accepted token), nats per committed token
    deviation: float  # share of committed tokens that differ from the base model's own choice
    steps: int
    tokens: int
    # each step also commits one token *sampled* from p (the next root): its expected regret against the base
    # model's own token, E_x~p[log p(own) - log p(x)] = log p(own) + H(p), per committed token; with ``regret``
    # it is what a typical-acceptance answer's tokens give up in all (0 for greedy decoding)
    sampling_regret: float = 0.0

    @property
    def total_regret(self) -> float:
        return self.regret + self.sampling_regret


# ---------------------------------------------------------------------------- replay


def passes(seq: TypicalSeq, params: TypicalParams) -> np.ndarray:
    """[P, K, k] bool: does head j's rank-r token pass the typical test at step position t?"""
    p, k_heads, _ = seq.logp.shape
    q = np.arange(p)[:, None] + np.arange(k_heads)[None, :] + 1  # [P, K] rollout index it is verified at
    entropy = seq.entropy[np.minimum(q, p)]  # past the end: any value, logp is -inf there
    # log threshold = min(log eps, log delta - H)
    log_thr = np.minimum(math.log(params.posterior_threshold), math.log(params.posterior_alpha) - entropy)
    return seq.logp > log_thr[:, :, None]


def accepted_per_position(seq: TypicalSeq, tree: Tree, params: TypicalParams) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """Per step position t: accepted depth, summed regret and number of differing tokens of the
    chosen path (longest passing path; ties by the largest summed log p, as the runtime does)."""
    check_fits(tree, seq.logp.shape[1], seq.logp.shape[2])
    n = seq.logp.shape[0]
    ok = passes(seq, params)
    q = np.minimum(np.arange(n)[:, None] + np.arange(seq.logp.shape[1])[None, :] + 1, n)  # [P, K]
    own = seq.greedy_logp[q]  # [P, K]: log p of the base model's own token there
    # per path: does every node pass, summed log p, summed regret, differing tokens
    state: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {
        (): (np.ones(n, bool), np.zeros(n), np.zeros(n), np.zeros(n))}
    best_len, best_score = np.zeros(n, int), np.zeros(n)
    best_regret, best_dev = np.zeros(n), np.zeros(n)
    for path in tree.paths:  # official order: parents come before children
        j, r = len(path) - 1, path[-1]
        p_ok, p_score, p_regret, p_dev = state[path[:-1]]
        lp = seq.logp[:, j, r]
        node_ok = p_ok & ok[:, j, r]
        score = p_score + np.where(node_ok, lp, 0.0)
        regret = p_regret + np.where(node_ok, own[:, j] - lp, 0.0)
        dev = p_dev + np.where(node_ok, (own[:, j] - lp) > 1e-6, 0)
        state[path] = (node_ok, score, regret, dev)
        d = len(path)
        better = node_ok & ((d > best_len) | ((d == best_len) & (score > best_score)))
        best_len = np.where(better, d, best_len)
        best_score = np.where(better, score, best_score)
        best_regret = np.where(better, regret, best_regret)
        best_dev = np.where(better, dev, best_dev)
    return best_len, best_regret, best_dev


def typical_walk(tree: Tree, seqs: Sequence[TypicalSeq], params: TypicalParams) -> TypicalResult:
    """Replay typical-acceptance decoding along each rollout (see the module doc)."""
    steps = tokens = 0
    regret = dev = sampled = 0.0
    for seq in seqs:
        depth, reg, devs = accepted_per_position(seq, tree, params)
        root = seq.greedy_logp + seq.entropy  # [M]: expected regret of sampling rollout token q from p
        t, n = 0, len(depth)
        while t < n:
            steps += 1
            tokens += 1 + int(depth[t])
            regret += float(reg[t])
            dev += float(devs[t])
            sampled += float(root[t])  # the step's root, at rollout index t, was sampled by the step before
            t += 1 + int(depth[t])
    if not steps:
        raise StatsError("no typical rollouts to replay")
    return TypicalResult(tokens / steps, regret / tokens, dev / tokens, steps, tokens, sampled / tokens)


# ---------------------------------------------------------------------------- JSON


def _encode(a: np.ndarray) -> str:
    return base64.b64encode(np.asarray(a, dtype="<f2").tobytes()).decode("ascii")


def _decode(text: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    if not isinstance(text, str):
        raise StatsError(f"typical '{name}' must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise StatsError(f"typical '{name}' is not valid base64") from e
    if len(raw) != 2 * math.prod(shape):
        raise StatsError(f"typical '{name}' holds {len(raw) // 2} values, expected {math.prod(shape)} for {shape}")
    return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)


def seq_to_json(seq: TypicalSeq) -> dict[str, Any]:
    return {"positions": int(seq.logp.shape[0]), "logp": _encode(seq.logp), "entropy": _encode(seq.entropy),
            "greedy_logp": _encode(seq.greedy_logp)}


def seq_from_json(obj: Any, num_heads: int, topk: int) -> TypicalSeq:
    if not isinstance(obj, dict) or not isinstance(obj.get("positions"), int) or obj["positions"] < 0:
        raise StatsError("typical rollout must be an object with a non-negative 'positions'")
    p = obj["positions"]
    return TypicalSeq(_decode(obj.get("logp"), (p, num_heads, topk), "logp"),
                      _decode(obj.get("entropy"), (p + 1,), "entropy"),
                      _decode(obj.get("greedy_logp"), (p + 1,), "greedy_logp"))


def typical_to_json(stats: TypicalStats) -> dict[str, Any]:
    return {"temperature": stats.temperature, "rollouts": [seq_to_json(s) for s in stats.rollouts],
            "heldout": [seq_to_json(s) for s in stats.heldout]}


def typical_from_json(obj: Any, num_heads: int, topk: int) -> TypicalStats:
    if not isinstance(obj, dict) or not isinstance(obj.get("temperature"), (int, float)) or obj["temperature"] <= 0:
        raise StatsError("'typical' must be an object with a positive 'temperature'")
    seqs = {key: tuple(seq_from_json(s, num_heads, topk) for s in obj.get(key, [])) for key in ("rollouts", "heldout")}
    return TypicalStats(float(obj["temperature"]), seqs["rollouts"], seqs["heldout"])
