"""Predicted against measured, per configuration, and ``report.json`` (schema ``medusa-report/1``).

Measured, from the replay's records: tokens/s (total tokens over total time), tau (committed tokens per
step, from the runtime's accept lengths), the speed-up over the runtime's own plain decoding on the same
questions with a paired 95 % bootstrap interval (questions resampled whole, both configurations' times
from the same draw), and the share of greedy outputs identical to plain decoding's. Predicted, from the
cross-fitted replay of calibration rollouts (``bench.replay.workload``): tau and speed-up over plain.
"""

from __future__ import annotations

import datetime
import json
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from bench.engines.peers import counters_summary, engine_of
from bench.replay.analyze import greedy_equality
from bench.replay.runner import PEER_METHODS, MethodConfig
from bench.replay.workload import ConfigPrediction, decoding_of
from treesearch.stats import bootstrap_ratio
from treesearch.targets import is_chain
from treesearch.tree import load_tree, write_json_atomic

REPORT_SCHEMA = "medusa-report/1"
TAU_TOLERANCE, SPEEDUP_TOLERANCE = 0.03, 0.05  # what "the prediction holds" means in the report


def _per_question(df: pd.DataFrame) -> pd.DataFrame:
    """[question] tokens, seconds, accepted tokens and steps of one configuration (turns summed)."""
    acc = df["accept_lengths"].map(lambda a: sum(a) if isinstance(a, list) else 0)
    return df.assign(accepted=acc).groupby("question_id")[["new_tokens", "wall_time", "accepted", "steps"]].sum()


def paired_speedup(df: pd.DataFrame, config: str, reference: str = "plain", seed: int = 0
                   ) -> tuple[float, tuple[float, float]]:
    """Speed-up of ``config`` over ``reference`` on the questions both ran: (point, 95 % paired interval).

    speed-up = (tokens_c / time_c) / (tokens_r / time_r) = (tokens_c * time_r) / (tokens_r * time_c); a
    bootstrap draw resamples questions and sums both configurations' numbers over the same draw."""
    mine, ref = _per_question(df[df["config"] == config]), _per_question(df[df["config"] == reference])
    common = mine.index.intersection(ref.index)
    if common.empty:
        return float("nan"), (float("nan"), float("nan"))
    a, b = mine.loc[common], ref.loc[common]
    rng = np.random.default_rng(seed)
    tc, sc = a["new_tokens"].to_numpy(float), a["wall_time"].to_numpy(float)
    tr, sr = b["new_tokens"].to_numpy(float), b["wall_time"].to_numpy(float)
    point = (tc.sum() / sc.sum()) / (tr.sum() / sr.sum())
    pick = rng.integers(0, len(common), size=(2000, len(common)))
    draws = (tc[pick].sum(1) / sc[pick].sum(1)) / (tr[pick].sum(1) / sr[pick].sum(1))
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return float(point), (float(lo), float(hi))


def measured_tau(df: pd.DataFrame, config: str) -> tuple[float | None, tuple[float, float] | None]:
    """Committed tokens per step (the runtime's accept lengths) with a bootstrap interval over questions."""
    sub = df[df["config"] == config]
    method = sub["method"].iloc[0]
    if method in PEER_METHODS:  # an engine: new tokens over its target forwards (bench.engines.peers.steps_of)
        q = _per_question(sub)
        if q["steps"].sum() == 0:
            return None, None
        return float(q["new_tokens"].sum() / q["steps"].sum()), bootstrap_ratio(q["new_tokens"], q["steps"])
    if method not in ("plain", "medusa"):
        return (1.0, (1.0, 1.0)) if method == "generate" else (None, None)
    q = _per_question(sub)
    if q["steps"].sum() == 0:
        return None, None
    return float(q["accepted"].sum() / q["steps"].sum()), bootstrap_ratio(q["accepted"], q["steps"])


def tokens_per_s_interval(df: pd.DataFrame, config: str) -> tuple[float, float]:
    """95 % bootstrap interval of a configuration's tokens/s (total tokens over total time), questions resampled."""
    q = _per_question(df[df["config"] == config])
    return bootstrap_ratio(q["new_tokens"], q["wall_time"])


def _one_or_all(values: list):
    """A configuration's setting: the value, or the sorted list of values where its folds differ."""
    return values[0] if len(values) == 1 else values


def scorecard(df: pd.DataFrame, configs: Sequence[MethodConfig], predictions: dict[str, ConfigPrediction],
              searched: str = "searched", engine_predictions: dict[str, list[float]] | None = None,
              startup: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per configuration name: what it is, measured, predicted, errors. ``engine_predictions``: per
    engine configuration, the accepted drafts per chain position predicted from calibration; ``startup``:
    per engine configuration, its start-up in seconds (``replay/engines.json``)."""
    same = greedy_equality(df, "plain").set_index("config")["identical_share"]
    rows = []
    for name in dict.fromkeys(c.name for c in configs):  # names in order, once (a pick runs per fold)
        if name not in set(df["config"]):
            continue
        cfg = next(c for c in configs if c.name == name)
        dec = decoding_of(cfg)
        sub = df[df["config"] == name]
        tau, tau_ci = measured_tau(df, name)
        speedup, ci = paired_speedup(df, name)
        mine = [c for c in configs if c.name == name]  # one per fold for the search's pick
        nodes = sorted({load_tree(c.tree).num_nodes - 1 for c in mine if c.tree})
        lookups = sorted({int(c.lookup_tokens) for c in mine}) if cfg.method in ("plain", "medusa") else [0]
        gates = sorted({float(c.gate) for c in mine})
        pred = predictions.get(name)
        engine = engine_of(cfg.method)
        row = {"config": name, "method": cfg.method, "engine": engine, "build": cfg.build,
               "uses_heads": cfg.method == "medusa" or cfg.speculative == "medusa",
               "heads": cfg.heads if cfg.heads is not None else ("main" if engine == "own" else None),
               "model": str(sub["model"].iloc[0]) if "model" in sub else None,
               "lookup": _one_or_all(lookups), "tree_nodes": _one_or_all(nodes) if nodes else None,
               "gate": _one_or_all(gates), "accept": _accept(cfg, float(sub["temperature"].max())),
               "temperature": float(sub["temperature"].max()),
               "questions": int(sub["question_id"].nunique()), "tokens": int(sub["new_tokens"].sum()),
               "tokens_per_s": float(sub["new_tokens"].sum() / sub["wall_time"].sum()),
               "tokens_per_s_ci": tokens_per_s_interval(df, name),
               "tau": tau, "tau_ci": tau_ci, "speedup_vs_plain": speedup, "speedup_vs_plain_ci": ci,
               "predicted_tau": pred.tau if pred else None,
               "predicted_tau_ci": pred.tau_interval if pred else None,
               "predicted_speedup_vs_plain": pred.speedup if pred else None,
               "fit_positions": pred.positions if pred else None,
               "predicted_on": None if pred is None else ("every question" if pred.complete else "a subset"),
               "searched": name == searched, "predictable": dec is not None,
               "identical_to_plain": float(same.get(name, float("nan")))}
        if pred and tau:
            row["tau_error"] = pred.tau / tau - 1
            row["speedup_error"] = pred.speedup / speedup - 1
        if engine in PEER_METHODS:
            row.update(_engine_fields(cfg, sub, (engine_predictions or {}).get(name), (startup or {}).get(name)))
        rows.append(row)
    _versus_engine_plain(rows, configs, df)
    return pd.DataFrame(rows)


def _versus_engine_plain(rows: list[dict], configs: list[MethodConfig], df: pd.DataFrame) -> None:
    """Each speculative engine row against the same engine's plain decoding of the same weights, paired per
    question: ``speedup_vs_engine_plain`` (+ ``_ci``) and ``step_cost_vs_engine_plain``, what one of its steps
    (draft, verify, bookkeeping) costs in plain steps: tau / speed-up. A speed-up is bounded by tau over that
    cost, so the two say whether acceptance or the engine's drafting overhead holds it back."""
    by_name = {c.name: c for c in configs}
    for row in rows:
        cfg = by_name[row["config"]]
        if row["engine"] not in PEER_METHODS or not cfg.speculative:
            continue
        plain = [r["config"] for r in rows if r["engine"] == row["engine"] and not by_name[r["config"]].speculative
                 and by_name[r["config"]].weights == cfg.weights]
        if not plain:
            continue
        speedup, ci = paired_speedup(df, row["config"], plain[0])
        row.update(engine_plain=plain[0], speedup_vs_engine_plain=speedup, speedup_vs_engine_plain_ci=ci,
                   step_cost_vs_engine_plain=row["tau"] / speedup if row["tau"] and speedup else None)


def _engine_fields(cfg: MethodConfig, sub: pd.DataFrame, predicted: list[float] | None,
                   startup: float | None) -> dict:
    """An engine row's own figures: its speculative decoding as the engine counted it, the prediction of its
    accepted drafts per position, its start-up (apart from the answers)."""
    counts = counters_summary(sub.to_dict("records")) if cfg.speculative else {}
    out = {"speculative": cfg.speculative, "draft_tokens": int(cfg.draft_tokens) or None,
           "weights": Path(cfg.weights).name if cfg.weights else None, "startup_s": startup,
           "draft_acceptance": counts.get("draft_acceptance"),
           "accepted_per_position": counts.get("accepted_per_position"),
           "predicted_accepted_per_position": predicted}
    if predicted is not None and out["accepted_per_position"] is not None:
        out["accepted_per_position_error"] = [m - p for m, p in zip(out["accepted_per_position"], predicted)]
    return out


def _accept(cfg: MethodConfig, temperature: float) -> str:
    """The acceptance rule as it ran: plain decoding at a temperature samples; transformers' methods are greedy
    or sample by the temperature too."""
    if cfg.method == "medusa":
        return cfg.accept
    return "sample" if temperature > 0 else "greedy"


def verdict(card: pd.DataFrame, searched: str = "searched") -> dict:
    """Was the pick the fastest lossless (greedy) configuration? Did every prediction hold within the stated
    tolerances? Sampled configurations (typical acceptance trades quality for speed) are not in the race."""
    greedy = card[card["temperature"].fillna(0.0) == 0.0]
    fastest = greedy.loc[greedy["tokens_per_s"].idxmax()]
    pick = card[card["config"] == searched]
    # predictions checked: those measured on every replayed question (a subset carries its own sampling noise,
    # which cross-fitting cancels only over all folds)
    predicted = card[card["predicted_tau"].notna() & (card["predicted_on"] == "every question")]
    if predicted.empty:  # a run without predictions (no heads): no errors to check
        predicted = predicted.assign(tau_error=pd.Series(dtype=float), speedup_error=pd.Series(dtype=float))
    out = {"fastest": fastest["config"], "fastest_tokens_per_s": float(fastest["tokens_per_s"]),
           "tau_tolerance": TAU_TOLERANCE, "speedup_tolerance": SPEEDUP_TOLERANCE,
           "predictions": int(len(predicted)),
           # None where nothing was predicted (not a vacuous "within")
           "tau_within_tolerance": bool((predicted["tau_error"].abs() <= TAU_TOLERANCE).all()) if len(predicted)
           else None,
           "speedup_within_tolerance": bool((predicted["speedup_error"].abs() <= SPEEDUP_TOLERANCE).all())
           if len(predicted) else None,
           "worst_tau_error": float(predicted["tau_error"].abs().max()) if len(predicted) else None,
           "worst_speedup_error": float(predicted["speedup_error"].abs().max()) if len(predicted) else None}
    # Medusa alone (what engines without a lookup chain serve): the fastest lossless configuration with heads and
    # no lookup chain, on the main heads
    medusa = greedy[greedy["uses_heads"] & (greedy["heads"] == "main")
                    & greedy["lookup"].map(lambda v: not any(v) if isinstance(v, list) else not v)]
    if not medusa.empty:
        best = medusa.loc[medusa["speedup_vs_plain"].idxmax()]
        out.update(fastest_heads_only=best["config"], fastest_heads_only_speedup=float(best["speedup_vs_plain"]),
                   fastest_heads_only_speedup_ci=best["speedup_vs_plain_ci"])
    engines = greedy[greedy["engine"].isin(PEER_METHODS)] if "engine" in greedy else greedy.iloc[:0]
    if not engines.empty:  # the fastest engine against the runtime's fastest, both measured in this replay
        peer = engines.loc[engines["tokens_per_s"].idxmax()]
        own = greedy[greedy["engine"] == "own"]
        best = own.loc[own["tokens_per_s"].idxmax()]
        out.update(fastest_engine=peer["config"], fastest_engine_tokens_per_s=float(peer["tokens_per_s"]),
                   fastest_own=best["config"], fastest_own_tokens_per_s=float(best["tokens_per_s"]),
                   own_vs_fastest_engine=float(best["tokens_per_s"] / peer["tokens_per_s"]))
    if not pick.empty:
        ratio = float(pick["tokens_per_s"].iloc[0] / fastest["tokens_per_s"])
        out.update(searched=searched, searched_is_fastest=bool(fastest["config"] == searched),
                   searched_vs_fastest=ratio)
    return out


def write_report(card: pd.DataFrame, summary: dict, meta: dict, out: Path) -> Path:
    """report.json: machine-readable, names kept stable for other tools (see DESIGN.md, 'Contracts')."""
    keep = ["config", "engine", "uses_heads", "heads", "model", "lookup", "tree_nodes", "gate", "accept", "temperature",
            "questions", "tokens", "tokens_per_s", "tokens_per_s_ci", "tau", "tau_ci", "speedup_vs_plain",
            "speedup_vs_plain_ci", "predicted_tau", "predicted_tau_ci", "predicted_speedup_vs_plain", "predicted_on",
            "fit_positions", "searched", "identical_to_plain"]
    engine_keep = ["build", "speculative", "draft_tokens", "weights", "startup_s", "draft_acceptance", "accepted_per_position",
                   "predicted_accepted_per_position", "accepted_per_position_error", "engine_plain",
                   "speedup_vs_engine_plain", "speedup_vs_engine_plain_ci", "step_cost_vs_engine_plain"]

    def clean(v):
        if isinstance(v, (tuple, list)):
            return [clean(x) for x in v]
        if isinstance(v, (float, np.floating)):
            return None if np.isnan(v) else round(float(v), 6)
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.bool_):
            return bool(v)
        return v

    quality = meta.get("quality") or {}
    configs = [{**{k: clean(r.get(k)) for k in keep}, "quality": quality.get(r["config"]),
                **({k: clean(r.get(k)) for k in engine_keep} if r.get("engine") in PEER_METHODS else {})}
               for r in card.to_dict("records")]
    obj = {"schema": REPORT_SCHEMA, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": meta.get("machine") or {"platform": platform.platform(), "node": platform.node()},
           "versions": meta.get("versions", {}), "questions": meta.get("questions", {}),
           "verdict": {k: clean(v) for k, v in summary.items()}, "configs": configs,
           "distribution_checks": meta.get("distribution_checks") or []}
    if meta.get("deploy"):
        obj["deploy"] = meta["deploy"]
    if meta.get("load"):
        obj["load"] = meta["load"]
    obj["engines_left_out"] = meta.get("engines_left_out") or []
    return write_json_atomic(out, obj)


NO_PREDICTIONS = ("No predictions in this run (nothing calibrated or searched, as in a run without heads): measured "
                  "figures only.")


def verdict_sentences(v: dict, strong=lambda text: text, esc=lambda text: text) -> list[str]:
    """The verdict in sentences, written once for the Markdown and the HTML report: ``strong`` marks the
    figures that answer the question (bold in HTML), ``esc`` escapes configuration names."""
    def pct(x):
        return f"{100 * (x or 0):.1f} %"

    lines = [f"Fastest measured: {strong(esc(v['fastest']))} ({v['fastest_tokens_per_s']:.1f} tokens/s)."]
    if "searched" in v:
        ratio = f"{v['searched_vs_fastest']:.3f}x"
        lines.append(f"The search's pick runs at {strong(ratio)} the fastest"
                     + (" (it is the fastest)." if v["searched_is_fastest"] else "."))
    if v.get("fastest_engine"):
        ratio = f"{v['own_vs_fastest_engine']:.2f}x"
        lines.append(f"Fastest engine beside the runtime (same questions, greedy, batch 1): "
                     f"{strong(esc(v['fastest_engine']))} ({v['fastest_engine_tokens_per_s']:.1f} tokens/s); the "
                     f"runtime's fastest, {esc(v['fastest_own'])}, runs at {strong(ratio)} it.")
    if v.get("fastest_heads_only"):
        lines.append(f"Medusa alone (heads, no lookup chain): {strong(esc(v['fastest_heads_only']))}, "
                     f"{v['fastest_heads_only_speedup']:.3f}x plain.")
    if not v.get("predictions"):
        lines.append(NO_PREDICTIONS)
    else:
        lines.append(f"Predictions checked on the {v['predictions']} configurations measured on every replayed question "
                     f"(cross-fitted; those run on a subset are shown, not checked): tau within "
                     f"{100 * v['tau_tolerance']:.0f} % for all: {strong('yes' if v['tau_within_tolerance'] else 'no')} "
                     f"(worst {pct(v['worst_tau_error'])}); speed-up within {100 * v['speedup_tolerance']:.0f} %: "
                     f"{strong('yes' if v['speedup_within_tolerance'] else 'no')} (worst {pct(v['worst_speedup_error'])}).")
    return lines


def deploy_summary(out: Path) -> dict | None:
    """What report.json says of the configuration to deploy (the run's tree.json), None without one."""
    path = out / "tree.json"
    final = json.loads(path.read_text()) if path.is_file() else None
    if not final or "configuration" not in final:
        return None
    return {"tree": "tree.json", "target": final.get("target"), "configuration": final["configuration"],
            "heads": final.get("heads"), "prediction": final.get("prediction"), "cost_model": final.get("cost_model")}


def deploy_line(deploy: dict | None) -> str:
    """One sentence on the configuration to deploy, for summary.md and the page."""
    if not deploy:
        return ""
    conf, pred, heads = deploy["configuration"], deploy.get("prediction") or {}, deploy.get("heads") or {}
    choices = conf.get("medusa_choices") or []
    what = (f"top-1 chain of {len(choices)}" if choices and is_chain(choices)
            else f"{len(choices)}-node tree" if choices else "no heads")
    extra = "".join([f", lookup {conf['lookup']}" if conf.get("lookup") else "",
                     f", gate {conf['gate']:g}" if conf.get("gate") else ""])
    ci = pred.get("speedup_vs_plain_ci") or [float("nan")] * 2
    return (f"To deploy ({deploy['target']}): tree.json, a {what}{extra} on the heads "
            f"{heads.get('name') or heads.get('path')}, predicted {pred.get('speedup_vs_plain', float('nan')):.3f}x "
            f"plain decoding ({ci[0]:.3f}-{ci[1]:.3f}), tau {pred.get('tau', float('nan')):.3f}; "
            f"medusa-bench export --tree tree.json --target {deploy['target']} --out DIR writes what it needs.")
