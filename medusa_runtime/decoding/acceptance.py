"""Acceptance rules on a verified tree: greedy, typical (Medusa paper) and exact speculative sampling.

Every rule sees the same inputs for one step:

* ``tokens``  [N] long: the candidate token of each tree node (node 0 is the root, already chosen)
* ``logits``  [N, V] float: the base model's next-token logits *after* each node
* ``buffers``: the tree's index tensors

and returns an :class:`Accepted`: the accepted root-to-node path (node ids, root first) and the
next token, drawn from the distribution after the path's last node. That token becomes the root
of the following step, so each step commits ``len(path)`` tokens.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from medusa_runtime import kernels
from medusa_runtime.tree.buffers import TreeBuffers
from treesearch.typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD

RULES = ("greedy", "typical", "sample")


@dataclass(frozen=True)
class AcceptConfig:
    rule: str = "greedy"  # greedy | typical | sample
    temperature: float = 0.0  # 0 = argmax; typical and sample use it for the target distribution
    top_p: float = 1.0  # nucleus filter of the target distribution (sample, typical's next token)
    top_k: int = 0  # top-k filter of the target distribution, 0 = off
    posterior_threshold: float = POSTERIOR_THRESHOLD  # typical: epsilon, the hard ceiling of the threshold
    posterior_alpha: float = POSTERIOR_ALPHA  # typical: delta, scales exp(-entropy)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown acceptance rule {self.rule!r}; use one of {', '.join(RULES)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        """Typical and sample at temperature 0 reduce to greedy decoding."""
        return self.rule == "greedy" or self.temperature == 0


@dataclass(frozen=True)
class Accepted:
    path: list[int]  # accepted node ids, root (0) first
    next_token: int  # the token after the last accepted node (root of the next step)


def warp(logits: torch.Tensor, cfg: AcceptConfig) -> torch.Tensor:
    """Target distribution [..., V] from logits: temperature, then top-k, then top-p."""
    scores = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop tokens once the mass *before* them already reaches top_p (the crossing token stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from ``probs`` [V] (not necessarily normalised) by inverting its CDF: the first index whose
    running sum exceeds u * total, u ~ U[0, 1) from ``gen``. Zero-probability tokens are never drawn (their
    running sum equals the one before); the sums are in float64, so the rounding of 1e5 float32 terms does
    not bias the draw. One uniform per draw, and ~20x faster here than torch.multinomial over a 49k vocabulary
    (1.06 against 0.05 ms on the development CPU), which a sampled decode step pays once."""
    cdf = torch.cumsum(probs.detach().reshape(-1).double().cpu(), dim=0)  # [V]
    u = float(torch.rand((), generator=gen, dtype=torch.float64)) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), cdf.numel() - 1)


def _longest_path(ok: torch.Tensor, buffers: TreeBuffers, score: torch.Tensor | None = None) -> list[int]:
    """Longest root-to-leaf prefix whose nodes all pass; ties broken by ``score`` summed along it."""
    ret = buffers.retrieve_indices  # [L, D+1], -1 padded
    ok_all = torch.cat([ok.new_ones(1), ok])  # root always passes
    passed = ok_all[ret.clamp(min=0)] & (ret >= 0)  # [L, D+1]
    lengths = passed.long().cumprod(dim=1).sum(dim=1)  # [L]
    best_len = int(lengths.max())
    rows = torch.nonzero(lengths == best_len).flatten()
    best = int(rows[0])
    if score is not None and len(rows) > 1:
        s = torch.cat([score.new_zeros(1), score])[ret[rows, :best_len]].sum(dim=1)
        best = int(rows[int(torch.argmax(s))])
    return ret[best, :best_len].tolist()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of ``logits`` [..., V] as ints (the first of tied maxima, as torch's).

    On the CPU: float32 or bf16 rows in one pass of the C library where it is built (~5 us a 49k-token row),
    else through NumPy on float32 (~20 us for one row, ~220 for four); torch's own argmax over bfloat16 takes
    ~230 us a row. A decode step pays it once per verified row."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    if logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16) and logits.numel() and \
            (lib := kernels.load()) is not None:
        rows = logits if logits.is_contiguous() else logits.contiguous()
        out = (ctypes.c_int64 * rows.shape[0])()
        lib.lean_argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.dtype == torch.bfloat16, out)
        return out[:]
    return logits.detach().float().numpy().argmax(axis=-1).tolist()


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers,
                  pred: list[int] | None = None) -> Accepted:
    """The longest root-to-node path whose every node is the base model's argmax after its parent (``pred``:
    each row's argmax where the forward already took it, as the C decode step does).

    One argmax over [N, V] and a walk of the tree in Python lists: a handful of nodes cost less as list
    lookups than as the dozen small tensor ops of :func:`_longest_path` (same length, same tokens).
    """
    if pred is None:
        pred = argmax_rows(logits)  # [N]: the base model's own next token after each node
    path = _greedy_walk(tokens.tolist(), pred, buffers.children, 0)
    return Accepted(path, pred[path[-1]])


def _greedy_walk(tok: list[int], pred: list[int], children: tuple[tuple[int, ...], ...], node: int) -> list[int]:
    """Longest path from ``node`` down through children that match their parent's argmax (ties: lower rank).

    Siblings hold distinct tokens except where a lookup draft repeats a head's candidate, so the walk
    rarely branches; every matching branch is explored and the deepest kept."""
    best: list[int] = []
    for child in children[node]:
        if tok[child] == pred[node]:
            sub = _greedy_walk(tok, pred, children, child)
            if len(sub) > len(best):
                best = sub
    return [node, *best]


def accept_typical(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers, cfg: AcceptConfig,
                   gen: torch.Generator | None) -> Accepted:
    """Accept x after node u when p_u(x) > min(epsilon, delta * exp(-H(p_u))), p at temperature T."""
    if cfg.temperature == 0:
        return accept_greedy(tokens, logits, buffers)
    parents = buffers.parent[1:]  # [N-1]
    if parents.numel():
        # only nodes with children need their distribution: one log-softmax per parent, not per node
        uniq, inv = torch.unique(parents, return_inverse=True)  # [P] parent nodes, [N-1] -> index into them
        logp = torch.log_softmax(logits[uniq].float() / cfg.temperature, dim=-1)  # [P, V]
        entropy = -(logp.exp() * logp).sum(-1)  # [P]
        threshold = torch.minimum(torch.full_like(entropy, cfg.posterior_threshold),
                                  cfg.posterior_alpha * torch.exp(-entropy))  # [P]
        lp_tok = logp[inv, tokens[1:]]  # [N-1]: log p of each candidate under its parent
        ok = lp_tok.exp() > threshold[inv]
        path = _longest_path(ok, buffers, score=lp_tok)
    else:
        path = [0]
    return Accepted(path, _sample(warp(logits[path[-1]], cfg), gen))


def accept_sample(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers, cfg: AcceptConfig,
                  gen: torch.Generator | None, residual: bool = True) -> Accepted:
    """Exact speculative sampling over the tree's siblings.

    The heads' candidates are deterministic (top-k), i.e. drafts with point-mass proposals q = 1[x].
    At node u, sibling x_i is accepted with probability min(1, p(x_i)/q(x_i)) = p(x_i); on rejection
    the target becomes the residual norm(max(0, p - q)) = p with x_i removed, renormalised. If every
    child is rejected the next token is drawn from the final residual. The committed tokens are
    then distributed exactly as sampling from p. ``residual=False`` skips the correction (biased,
    kept only so that tests can show the chi-square check has power).
    """
    if cfg.temperature == 0:
        return accept_greedy(tokens, logits, buffers)
    node, path = 0, [0]
    tok = tokens.tolist()
    while True:
        p = warp(logits[node], cfg).cpu()  # [V]
        chosen = None
        for child in buffers.children[node]:
            x = tok[child]
            u = float(torch.rand((), generator=gen))
            if u < float(p[x]):
                chosen = child
                break
            if residual:
                p[x] = 0.0
                p = p / p.sum()
        if chosen is None:
            return Accepted(path, _sample(p, gen))
        path.append(chosen)
        node = chosen


def accept(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers, cfg: AcceptConfig,
           gen: torch.Generator | None = None, pred: list[int] | None = None) -> Accepted:
    """The accepted path and the next token under ``cfg``'s rule (``pred``: each row's argmax, if known)."""
    if cfg.rule == "greedy" or cfg.temperature == 0:
        return accept_greedy(tokens, logits, buffers, pred)
    if cfg.rule == "typical":
        return accept_typical(tokens, logits, buffers, cfg, gen)
    return accept_sample(tokens, logits, buffers, cfg, gen)


def first_token(logits: torch.Tensor, cfg: AcceptConfig, gen: torch.Generator | None = None) -> int:
    """The token after the prompt: argmax, or a draw from the warped distribution."""
    if cfg.is_greedy:
        return argmax_rows(logits.reshape(-1))
    return _sample(warp(logits, cfg), gen)
