"""A learning curve of Medusa heads: points (training tokens, head top-1, tau@32) from sets trained on nested
prefixes of one prompt mix, a log-linear fit over them, and the tokens the fit puts at a target (also from the
two largest sets alone, where a bend shows).

``learning_curve.json`` (schema ``medusa-learning-curve/1``): the recipe (the job's fields), the question set,
and one row per point; ``learning_curve.md`` is its table. The fit, y = a + b log10(tokens), is the usual
shape of a data-limited curve; with three points it is a rough guide, reported as such, not a prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SCHEMA = "medusa-learning-curve/1"
TAU_NODES = 32  # tau of the best tree of this many nodes (treesearch.optimal, replayed on the rollouts)
TARGETS = {"head0_top1": 0.50, "tau32": 2.5}  # the release targets the curve is read against
MAX_LOG10_TOKENS = 15  # a target the line meets beyond 10^15 tokens is reported as out of its reach


def point_row(prompts: int, training: dict, topk: Sequence[Sequence[float]], trees: Sequence[dict]) -> dict:
    """One point: the trained set's ``training.json`` (sizes, steps, seconds), the calibration's top-k accuracy
    per head (``topk[j][r]``: top-(r+1) of head j) and its replayed trees (``optimal-32`` gives tau@32, ``chain:2``
    tau of the two-token chain engines run)."""
    best = next(t for t in trees if t["tree"] == f"optimal-{TAU_NODES}")
    two = next(t for t in trees if t["tree"] == "chain:2")
    return {"prompts": prompts, "examples": training["examples"]["train"],
            "train_tokens": training["examples"]["train_tokens"], "steps": training["steps"],
            "train_seconds": round(training["train_seconds"], 1),
            "head_top1": [round(row[0], 4) for row in topk], "head0_top1": round(topk[0][0], 4),
            "tau32": round(best["tau"], 4), "tau32_interval": [round(v, 4) for v in best["tau_interval"]],
            "tau_chain2": round(two["tau"], 4), "tau_chain2_interval": [round(v, 4) for v in two["tau_interval"]]}


def log_fit(tokens: Sequence[float], values: Sequence[float], target: float) -> dict:
    """y = a + b log10(tokens) by least squares: b (the gain per tenfold data), and the tokens at which the line
    reaches ``target`` (None when it does not rise, or only beyond 10^15 tokens)."""
    if len(tokens) < 2 or len(set(tokens)) < 2:
        return {"per_10x": None, "tokens_at_target": None, "target": target}
    b, a = np.polyfit(np.log10(np.asarray(tokens, dtype=float)), np.asarray(values, dtype=float), 1)
    exponent = (target - a) / b if b > 0 else math.inf
    reach = float(f"{10 ** exponent:.3g}") if exponent <= MAX_LOG10_TOKENS else None
    return {"per_10x": round(float(b), 4), "intercept": round(float(a), 4), "target": target,
            "tokens_at_target": reach}


def curve_fits(rows: Sequence[dict]) -> dict[str, dict]:
    """Per metric, the fit over every point and (``last_pair``) the line through the two largest sets alone: a
    curve that bends shows there as a smaller gain and a farther target."""
    rows = sorted(rows, key=lambda r: r["train_tokens"])
    tokens = [r["train_tokens"] for r in rows]
    fits = {}
    for metric, target in TARGETS.items():
        fits[metric] = log_fit(tokens, [r[metric] for r in rows], target)
        if len(rows) > 2:
            fits[metric]["last_pair"] = log_fit(tokens[-2:], [r[metric] for r in rows[-2:]], target)
    return fits


def _tokens(n: float) -> str:
    return f"{n:,.0f}" if n < 1e9 else f"{n:.1e}"


def curve_table(curve: dict) -> str:
    """The curve as Markdown: one row per point, then the fit's reading."""
    lines = ["| prompts | examples | training tokens | steps | train s | head 0 top-1 | heads 1.. top-1 | tau chain:2 "
             "| tau@32 (95 % interval) |", "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in curve["points"]:
        lo, hi = r["tau32_interval"]
        rest = " ".join(f"{v:.3f}" for v in r["head_top1"][1:])
        lines.append(f"| {r['prompts']} | {r['examples']} | {r['train_tokens']:,} | {r['steps']} | "
                     f"{r['train_seconds']:.0f} | {r['head0_top1']:.3f} | {rest} | {r['tau_chain2']:.3f} | "
                     f"{r['tau32']:.3f} ({lo:.3f}-{hi:.3f}) |")
    for metric, fit in curve.get("fits", {}).items():
        if fit["per_10x"] is None:
            continue
        reach = fit["tokens_at_target"]
        where = f"reaches {fit['target']} near {_tokens(reach)} training tokens" if reach else \
            f"does not reach {fit['target']} within 1e{MAX_LOG10_TOKENS} tokens" if fit["per_10x"] > 0 else \
            f"does not rise towards {fit['target']}"
        lines.append(f"\n{metric}: {fit['per_10x']:+.3f} per tenfold data (log-linear fit over "
                     f"{len(curve['points'])} points; the line {where}).")
        if fit.get("last_pair", {}).get("per_10x") is not None:
            pair = fit["last_pair"]
            reach = pair["tokens_at_target"]
            lines[-1] += (f" Between the two largest sets alone: {pair['per_10x']:+.3f} per tenfold data, "
                          + (f"reaching {pair['target']} near {_tokens(reach)} tokens." if reach else
                             f"not reaching {pair['target']}."))
    return "\n".join(lines)
