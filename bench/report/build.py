"""Report of a bench run: summary table and paper-style plots from the files the stages wrote."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from bench.engines.stage import ACCEPTANCE, NOTES
from bench.replay.analyze import greedy_equality, records_frame, summary, to_markdown  # noqa: E402
from bench.replay.distributed import machine_dir
from bench.replay.mtbench import CATEGORIES  # noqa: E402
from bench.replay.runner import (
    MethodConfig,
    load_records,  # noqa: E402
)
from bench.replay.workload import MIN_POSITIONS, fold_stats, predict_configs
from bench.report.html import write_html
from bench.report.load import load_section
from bench.report.plots import (  # noqa: E402
    distinct_colours,
    plot_engines_headline,
    plot_headline,
    plot_training,
    plot_typical_measured,
    save_figure,
)
from bench.report.scorecard import (
    NO_PREDICTIONS,
    deploy_line,
    deploy_summary,
    paired_speedup,
    scorecard,
    verdict,
    verdict_sentences,
    write_report,
)
from treesearch.cost import load_profile, mean_profile
from treesearch.fsutil import atomic_file
from treesearch.stats import chain_accepted_per_position, load_stats

# the Medusa paper's overall MT-Bench speed-ups (Cai et al. 2024, Vicuna-7B on an A100, batch 1)
PAPER_OVERALL = {"Medusa-1": 2.18, "Medusa-2": 2.83}
PAPER_TITLE = "For reference: the Medusa paper's overall speed-ups"
PAPER_NOTE = ("Vicuna-7B on an A100 GPU, over its own plain decoding on MT-Bench: another model, another machine, "
              "not comparable with this run's figures.")


def paper_table() -> pd.DataFrame:
    return pd.DataFrame([{"method": k, "model": "Vicuna-7B", "hardware": "A100 GPU", "speedup_vs_plain": v}
                         for k, v in PAPER_OVERALL.items()])


def category_intervals(df: pd.DataFrame, baseline: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(config, category or 'overall') -> 95 % paired bootstrap interval of the speed-up over ``baseline``,
    questions resampled within the category (``scorecard.paired_speedup``)."""
    out = {}
    for cat, sub in [*df.groupby("category", sort=False), ("overall", df)]:
        for cfg in sub["config"].unique():
            if cfg != baseline and (sub["config"] == baseline).any():
                _, ci = paired_speedup(sub, cfg, baseline)
                if np.isfinite(ci).all():
                    out[(cfg, cat)] = ci
    return out


def plot_speedup_by_category(table: pd.DataFrame, baseline: str, out_dir: Path,
                             intervals: dict[tuple[str, str], tuple[float, float]] | None = None) -> list[Path]:
    """Figure-3 layout: grouped bars, one group per MT-Bench category, one bar per configuration; whiskers
    from ``intervals`` ((config, category) -> (lo, hi)) where given."""
    col = f"speedup_vs_{baseline}"
    configs = [c for c in table["config"].unique() if c != baseline]
    cats = [c for c in CATEGORIES if c in set(table["category"])] + ["overall"]
    fig, ax = plt.subplots(figsize=(13, 4))
    width = 0.8 / max(1, len(configs))
    colours = distinct_colours(len(configs))
    for i, cfg in enumerate(configs):
        sub = table[table["config"] == cfg].set_index("category")[col]
        heights = np.array([sub.get(c, np.nan) for c in cats], dtype=float)
        err = None
        if intervals:  # asymmetric whiskers [2, categories]; none where a category has no interval
            ci = [intervals.get((cfg, c), (h, h)) for c, h in zip(cats, heights)]
            err = np.abs(np.array([[h - lo for (lo, _), h in zip(ci, heights)], [hi - h for (_, hi), h in zip(ci, heights)]]))
        ax.bar(np.arange(len(cats)) + i * width, heights, width, label=cfg, yerr=err, capsize=2,
               error_kw={"lw": 0.7}, color=colours[i])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(cats)) + width * (len(configs) - 1) / 2)
    ax.set_xticklabels(cats, rotation=20)
    ax.set_ylabel(f"speed-up over {baseline} (tokens/s ratio)")
    ax.set_title(f"speed-up per category over {baseline}" + (" (95 % paired intervals over questions)" if intervals else ""))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no bar hidden
    return save_figure(fig, out_dir, f"speedup_by_category_vs_{baseline}")


def plot_tau_by_category(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    names = table["config"].unique()
    # the heads' configurations; in a run without heads, the lookup chains (what else verifies several tokens)
    medusa = [c for c in names if c.startswith("medusa")] or [c for c in names if "+lookup" in c]
    if not medusa:
        return []
    cats = [c for c in CATEGORIES if c in set(table["category"])] + ["overall"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    width = 0.8 / max(1, len(medusa))
    colours = distinct_colours(len(medusa))
    for i, cfg in enumerate(medusa):
        sub = table[table["config"] == cfg].set_index("category")["tau"]
        ax.bar(np.arange(len(cats)) + i * width, [sub.get(c, np.nan) for c in cats], width, label=cfg,
               color=colours[i])
    ax.set_xticks(np.arange(len(cats)) + width * (len(medusa) - 1) / 2)
    ax.set_xticklabels(cats, rotation=20)
    ax.set_ylabel("tau (tokens per step)")
    ax.set_title("accepted length per category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no bar hidden
    return save_figure(fig, out_dir, "tau_by_category")


def plot_speedup_vs_quality(table: pd.DataFrame, quality: pd.Series, baseline: str, ylabel: str, title: str,
                            out_dir: Path, ylim: tuple[float, float] | None = (-0.05, 1.05)) -> list[Path]:
    """Speed (overall speed-up over ``baseline``) against a quality figure per configuration (``quality``:
    config -> value), each configuration named in the legend."""
    overall = table[table["category"] == "overall"].set_index("config")[f"speedup_vs_{baseline}"]
    fig, ax = plt.subplots(figsize=(9, 4))
    markers = "osD^v<>ph*"
    for i, (cfg, value) in enumerate(quality.dropna().items()):
        if cfg in overall.index:
            ax.scatter([overall[cfg]], [value], s=45, marker=markers[i % len(markers)], label=f"{cfg} ({value:.2f})")
    ax.set_xlabel(f"speed-up over {baseline} (tokens/s ratio)")
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, out_dir, "speedup_vs_quality")


def _machine_folder(out: Path, machine: str, records: list[dict]) -> Path:
    """``out/machines/<machine>/`` holding that machine's records as a run folder of its own."""
    folder = machine_dir(out, machine)
    with atomic_file(folder / "replay" / "records.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records if r.get("machine") == machine))
    return folder


def report(out: Path) -> list[Path]:
    plots = out / "plots"
    records = load_records(out / "replay" / "records.jsonl")
    machines = sorted({r["machine"] for r in records if r.get("machine")})
    if len(machines) > 1:  # a replay shared among machines: one report per machine, never a ratio across two
        return [p for m in machines for p in report(_machine_folder(out, m, records))]
    df = records_frame(records)
    table = summary(df, ["generate", "plain"])
    eq_both = _identical(df)
    judged = _read(out / "judge" / "judge_scores.json")
    quality = _read(out / "quality.json")
    written = _category_figures(df, table, plots) + _quality_figure(table, eq_both, judged, plots)
    load_md, load_doc, load_figures = load_section(out, plots)
    section, scored = _scorecard_files(out, df, records, quality, judged, plots, load_doc)
    section += load_md
    notes = (_read(out / "engines" / NOTES) or {}).get("left_out", [])
    section += "".join(f"\nEngine left out: {n}\n" for n in notes)
    written += scored + load_figures + _typical_measured(out, df, quality, plots) + _training_figure(out, plots)
    overall = table[table["category"] == "overall"][["config", "tokens", "seconds", "tokens_per_s", "tau",
                                                       "speedup_vs_generate", "speedup_vs_plain"]]
    by_category = table.pivot(index="category", columns="config", values="speedup_vs_generate").reset_index()
    by_category.columns.name = None
    md = (section + "\n## Overall\n\n" + to_markdown(overall)
          + "\n\n## Speedup over transformers generate, per category\n\n"
          + to_markdown(by_category)
          + "\n\n## Greedy outputs identical to generate (identical) and to the runtime's plain decoding "
            "(identical_to_plain)\n\n" + _weights_note(records) + to_markdown(eq_both) + "\n" + typical_section(out)
          + f"\n## {PAPER_TITLE}\n\n{PAPER_NOTE}\n\n" + to_markdown(paper_table()) + "\n")
    (out / "summary.md").write_text(md)
    print(md)

    page = write_html(out, {"Overall": overall, "Speed-up over transformers generate, per category": by_category,
                            "Greedy outputs identical to generate and to the runtime's plain decoding (proxies)":
                            eq_both, PAPER_TITLE: paper_table()}, _records_meta(records), judge=judged, quality=quality)
    return [out / "summary.md", page, *[p for p in written if p.suffix in (".png", ".json")]]


def _identical(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the greedy outputs identical to generate's and to the runtime's plain decoding's."""
    eq = greedy_equality(df, "generate")
    # in bf16 the runtime's C forward rounds its own way (not as transformers does): Medusa's exactness
    # shows against the runtime's plain decoding
    to_plain = greedy_equality(df, "plain")[["config", "identical", "identical_share"]].rename(
        columns={"identical": "identical_to_plain", "identical_share": "identical_to_plain_share"})
    return eq.merge(to_plain, on="config", how="left")


def _category_figures(df: pd.DataFrame, table: pd.DataFrame, plots: Path) -> list[Path]:
    """Speed-up and tau per category; they show the lossless (greedy) configurations, the sampled ones have a
    figure of their own."""
    greedy = df[df["temperature"].fillna(0.0) == 0.0] if "temperature" in df else df
    lossless = table[table["config"].isin(set(greedy["config"]))]
    return (plot_speedup_by_category(lossless, "generate", plots, category_intervals(greedy, "generate"))
            + plot_speedup_by_category(lossless, "plain", plots, category_intervals(greedy, "plain"))
            + plot_tau_by_category(lossless, plots))


def _quality_figure(table: pd.DataFrame, eq_both: pd.DataFrame, judged: dict | None, plots: Path) -> list[Path]:
    """Speed against the judge's score where a judge graded, else against the lossless check."""
    if judged is not None and any(c["score"] is not None for c in judged["configs"].values()):
        scores = pd.Series({cfg: c["score"] for cfg, c in judged["configs"].items()}, dtype=float)
        return plot_speedup_vs_quality(table, scores, "plain", f"judge score (1-10, {judged['judge']})",
                                       "speed vs quality (FastChat single grading)", plots, ylim=(0.5, 10.5))
    return plot_speedup_vs_quality(table, eq_both.set_index("config")["identical_to_plain_share"], "plain",
                                   "greedy outputs identical to plain decoding", "speed vs the lossless check "
                                   "(a proxy: no judge)", plots)


def _scorecard_files(out: Path, df: pd.DataFrame, records: list[dict], quality: dict | None, judged: dict | None,
                     plots: Path, load: dict | None = None) -> tuple[str, list[Path]]:
    """The scorecard's section of summary.md, report.json and the figures drawn from it (none without
    predictions to score)."""
    scored = scorecard_of(out, df)
    if scored is None:
        return "", []
    card, verdict, questions = scored
    written = plot_predicted_vs_measured(card, plots)
    section = scorecard_section(card, verdict) + (f"\nPredicted speeds are priced with "
                                                  f"{questions['predictions_priced_with']}.\n"
                                                  if verdict["predictions"] else "")
    deploy = deploy_summary(out)
    if line := deploy_line(deploy):
        section += f"\n{line}\n"
    written.append(write_report(card, verdict, {"versions": records[0].get("versions", {}),
                                                "machine": _machine(out), "questions": questions,
                                                "quality": quality_of(card, quality, judged),
                                                "distribution_checks": (quality or {}).get("distribution_checks"),
                                                "deploy": deploy, "load": load,
                                                "engines_left_out": (_read(out / "engines" / NOTES) or {}).get(
                                                    "left_out", [])},
                                out / "report.json"))
    # the headline: every engine's plain and fastest speculative configuration
    configs = json.loads((out / "report.json").read_text())["configs"]
    return section, written + plot_headline(configs, plots) + plot_engines_headline(configs, plots)


def _training_figure(out: Path, plots: Path) -> list[Path]:
    """The training curves of a run that trained its heads (--retrain); an earlier run's are removed."""
    trained = out / "heads-trained"
    (plots / "training_curves.png").unlink(missing_ok=True)
    (plots / "training_curves.svg").unlink(missing_ok=True)
    return plot_training(trained, plots) if (trained / "training.json").is_file() else []


def _typical_measured(out: Path, df: pd.DataFrame, quality_file: dict | None, plots: Path) -> list[Path]:
    """Sampled configurations' measured speed-up (paired over questions) and regret (quality.json), beside the
    predicted front."""

    quality = (quality_file or {}).get("configs", {})
    sampled = [c for c, q in quality.items() if q.get("temperature", 0) > 0 and c in set(df["config"])]
    if not sampled:
        return []
    measured = []
    for cfg in sampled:
        point, (lo, hi) = paired_speedup(df, cfg, "plain")
        measured.append({"config": cfg, "regret": quality[cfg]["regret_per_token"], "speedup": point, "lo": lo,
                         "hi": hi})
    front = ((_read(out / "tree-typical.json") or {}).get("acceptance") or {}).get("pareto") or []
    return plot_typical_measured(front, measured, plots)


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def quality_of(card: pd.DataFrame, quality_file: dict | None, judge_file: dict | None) -> dict[str, dict]:
    """report.json's ``quality`` per configuration: the lossless check (share identical to plain decoding), the
    log-likelihood proxy (quality.json) and the judge's scores (judge/judge_scores.json) where the run has them."""
    ll = (quality_file or {}).get("configs", {})
    judged = (judge_file or {}).get("configs", {})
    out_q = {}
    for r in card.to_dict("records"):
        cfg, same = r["config"], r.get("identical_to_plain")
        greedy = (r.get("temperature") or 0.0) == 0.0
        out_q[cfg] = {"identical_to_plain": float(same) if greedy and same is not None and same == same else None,
                      "log_likelihood_per_token": ll.get(cfg, {}).get("log_likelihood_per_token"),
                      "regret_per_token": ll.get(cfg, {}).get("regret_per_token"),
                      "judge_score": judged.get(cfg, {}).get("score"),
                      "judge_by_category": judged.get(cfg, {}).get("by_category") or None}
    return out_q


def _weights_note(records: list[dict]) -> str:
    """What `identical` and `token_agreement` compare where the runtime decoded Q4_1 blocks: its answers against
    transformers' generate on the dense weights the file dequantises to."""
    if not records or records[0].get("weights") != "q4_1":
        return ""
    return ("The runtime decoded the layers' Q4_1 blocks (`--weights q4_1`) and transformers' generate the dense "
            f"{records[0].get('dtype')} weights they dequantise to: `identical` and `token_agreement` (the share of "
            "positions holding the same token) are how often Q4_1 answers equal the dense ones. A row decoded on "
            "another base (a compared head set's) has no dense answers to meet: it is compared with that base's "
            "plain Q4_1 decoding, which `reference` names.\n\n")


def _records_meta(records: list[dict]) -> dict:
    """Model, heads, dtype, device and versions as the replay's records name them (the heads most records
    decoded with: the main heads, whose configurations outnumber a compared set's chains)."""
    first = records[0]
    named = Counter(r["heads"] for r in records if r.get("heads")).most_common(1)
    heads = named[0][0] if named else None
    return {k: first.get(k) for k in ("model", "dtype", "weights", "device", "versions")} | {"heads": heads}


def _machine(out: Path) -> dict:
    """The machine the latency profile describes (where the replay ran too)."""
    lat = out / "latency.json"
    return json.loads(lat.read_text()).get("machine", {}) if lat.is_file() else {}


def plot_predicted_vs_measured(card: pd.DataFrame, plots: Path) -> list[Path]:
    """Each predicted configuration's measured speed-up over plain against its prediction (y = x: exact)."""
    rows = card[card["predicted_speedup_vs_plain"].notna()]
    if rows.empty:
        return []
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    lo = min(rows["predicted_speedup_vs_plain"].min(), rows["speedup_vs_plain"].min()) * 0.95
    hi = max(rows["predicted_speedup_vs_plain"].max(), rows["speedup_vs_plain"].max()) * 1.05
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="prediction = measurement")
    ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="tab:green", alpha=0.15,
                    label="within 5 %")
    markers = "osD^v<>ph"
    for i, (_, r) in enumerate(rows.iterrows()):  # named in the legend: close points would hide each other's labels
        ci = r["speedup_vs_plain_ci"]
        ax.errorbar([r["predicted_speedup_vs_plain"]], [r["speedup_vs_plain"]],
                    yerr=[[r["speedup_vs_plain"] - ci[0]], [ci[1] - r["speedup_vs_plain"]]],
                    fmt="*" if r["searched"] else markers[i % len(markers)], ms=11 if r["searched"] else 6,
                    capsize=2, label=f"{r['config']}: {r['speedup_vs_plain']:.2f} measured, "
                                     f"{r['predicted_speedup_vs_plain']:.2f} predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes (0.6, 1.0, 1.5), no powers of ten
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
        axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    ax.set_xlabel("predicted speed-up over plain (cross-fitted replay + latency profile)")
    ax.set_ylabel("measured speed-up over plain (95 % interval)")
    ax.set_title("the search's predictions against the replay")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, plots, "predicted_vs_measured")


def scorecard_of(out: Path, df: pd.DataFrame) -> tuple[pd.DataFrame, dict, dict] | None:
    """(scorecard, verdict, questions) of a bench run, or None outside the pipeline (no workload.json)."""
    files = [out / n for n in ("workload.json", "acceptance.json", "latency.json", "replay_config.json")]
    if not (files[0].is_file() and files[3].is_file()):
        return None
    workload = json.loads(files[0].read_text())
    configs = [MethodConfig(**c) for c in json.loads(files[3].read_text())["configurations"]]
    folds = [tuple(f) for f in workload["folds"]]
    if not (files[1].is_file() and files[2].is_file()):  # --heads none: nothing calibrated, nothing predicted
        predictions, priced = {}, "nothing (a run without heads: no calibration, no search)"
    else:
        stats, latency = load_stats(files[1]), load_profile(files[2])
        priced = "the latency profile measured before the replay"
        during = out / "replay" / "latency-during.json"
        if during.is_file():  # the same grid profiled in rounds between the replayed questions (bench.replay.profile_rounds)
            latency = load_profile(during)
            priced = f"the latency profile taken {latency.meta.get('taken', 'during the replay')}"
        elif (out / "latency-after.json").is_file():  # older runs: before and after the replay, averaged
            latency = mean_profile([latency, load_profile(out / "latency-after.json")])
            priced = "the mean of the latency profiles measured before and after the replay"
        predictions = predict_configs(configs, fold_stats(stats, folds), folds, latency)
    card = scorecard(df, configs, predictions, engine_predictions=engine_predictions(out, configs),
                     startup=(_read(out / "replay" / "engines.json") or {}).get("startup_s"))
    questions = {k: workload[k] for k in ("questions", "total", "replayed", "folds", "calibration", "max_new_tokens",
                                          "turns", "peers")}
    questions["predictions_priced_with"] = priced
    return card, verdict(card), questions


def engine_predictions(out: Path, configs) -> dict[str, list[float]]:
    """Per vLLM + Medusa configuration, its accepted drafts per chain position predicted from the calibration of
    the same heads, in vLLM's vocabulary, on the replayed questions (``engines/acceptance-vllm-medusa.json``):
    the top-1 chain walked along the runtime's greedy rollouts (``treesearch.stats.chain_accepted_per_position``)."""
    path = out / "engines" / ACCEPTANCE
    medusa = [c for c in configs if c.method == "vllm" and c.speculative == "medusa"]
    if not medusa or not path.is_file():
        return {}
    stats = load_stats(path)
    rollouts = stats.rollouts + stats.heldout
    return {c.name: chain_accepted_per_position(rollouts, c.draft_tokens) for c in medusa
            if c.draft_tokens <= stats.num_heads}


def scorecard_section(card: pd.DataFrame, summary: dict) -> str:
    cols = ["config", "questions", "lookup", "tree_nodes", "gate", "tokens_per_s", "tau", "predicted_tau",
            "predicted_tau_ci", "tau_error",
            "speedup_vs_plain", "speedup_vs_plain_ci", "predicted_speedup_vs_plain", "speedup_error",
            "identical_to_plain"]
    shown = card[[c for c in cols if c in card.columns]].copy()
    for col in ("speedup_vs_plain_ci", "predicted_tau_ci"):  # intervals as lo-hi
        shown[col] = shown[col].map(lambda c: f"{c[0]:.3f}-{c[1]:.3f}" if isinstance(c, tuple) else "-")

    sentences = verdict_sentences(summary)
    lines = sentences[:1]
    thin = card[card["fit_positions"].notna() & (card["fit_positions"] < MIN_POSITIONS)]
    for _, r in thin.iterrows():  # too few positions: the prediction's interval says how little it knows
        lo, hi = r["predicted_tau_ci"]
        lines.append(f"Few calibration positions behind {r['config']} ({int(r['fit_positions'])} < {MIN_POSITIONS}): "
                     f"predicted tau {r['predicted_tau']:.3f}, 95 % interval {lo:.3f}-{hi:.3f}.")
    lines += sentences[1:]
    if sentences[-1] == NO_PREDICTIONS:
        return "\n## Configurations: measured (this replay)\n\n" + to_markdown(shown.round(3)) + "\n\n" + \
            "\n".join(lines) + "\n"
    return ("\n## Configurations: measured (this replay) and predicted (cross-fitted replay of calibration rollouts "
            "+ latency profile)\n\n" + to_markdown(shown.round(3)) + "\n\n" + "\n".join(lines) + "\n")


def typical_section(out: Path) -> str:
    """The typical-acceptance search's Pareto front (predicted by replay, not measured)."""
    f = out / "tree-typical.json"
    if not f.is_file():
        return ""
    acc = json.loads(f.read_text()).get("acceptance") or {}
    front = pd.DataFrame([{"nodes": len(p["medusa_choices"]), "epsilon": p["posterior_threshold"],
                           "delta": p["posterior_alpha"], "tau": p["tau"], "predicted_speedup": p["speedup"],
                           "regret_nats_per_token": p["regret"], "with_sampled_tokens": p.get("total_regret")}
                          for p in acc.get("pareto", [])])
    if front.empty:
        return ""
    return (f"\n## Typical acceptance at temperature {acc['temperature']} (replayed, predicted)\n\n"
            f"Chosen (fastest within {acc['max_regret']} nats/token of regret): epsilon "
            f"{acc['posterior_threshold']:.4f}, delta {acc['posterior_alpha']:.4f}, regret "
            f"{acc['predicted_regret']:.4f}. Regret: the accepted drafts' (what the search constrains); "
            "with_sampled_tokens: plus the token each step samples, comparable with an answer's measured regret "
            "(quality.json). Pareto front:\n\n" + to_markdown(front.round(4)) + "\n")




class ReportError(ValueError):
    """A report.json that does not show what was asked of it, with a one-line reason."""


def check_report(out: Path, device: str | None = None) -> str:
    """One line on the run in ``out`` when its report.json holds a measured speed-up of the searched configuration
    over the runtime's plain decoding (on ``device``'s kind, when given: ``cuda``, ``cpu``); else ReportError."""
    path = out / "report.json"
    if not path.is_file():
        raise ReportError(f"no report.json in {out}")
    rep = json.loads(path.read_text())
    ran_on = str((rep.get("machine") or {}).get("device", ""))
    if device is not None and ran_on.split(":")[0] != device:
        raise ReportError(f"{path} was measured on {ran_on or 'an unknown device'}, not {device}")
    searched = [c for c in rep.get("configs", []) if c.get("searched") and c.get("engine", "own") == "own"]
    measured = [c for c in searched if c.get("speedup_vs_plain") is not None and c.get("tokens_per_s")]
    if not measured:
        raise ReportError(f"{path} holds no measured speed-up of the searched configuration")
    best = measured[0]
    lo, hi = best.get("speedup_vs_plain_ci") or (None, None)
    where = (rep.get("machine") or {}).get("gpu") or (rep.get("machine") or {}).get("cpu_model") or ran_on
    interval = f" ({lo:.2f}-{hi:.2f})" if lo is not None else ""
    return (f"{best['config']}: {best['tokens_per_s']:.1f} tokens/s, {best['speedup_vs_plain']:.2f}x{interval} "
            f"plain decoding, measured on {where} ({ran_on}), {best.get('questions')} questions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description="check a bench run's report.json")
    parser.add_argument("--check", metavar="OUT", required=True, help="the run's folder (the pipeline's --out)")
    parser.add_argument("--device", default=None, help="the kind of device it must have run on: cuda, cpu")
    args = parser.parse_args(argv)
    try:
        print(check_report(Path(args.check), args.device))
    except (ReportError, OSError, json.JSONDecodeError) as exc:
        print(f"python -m bench.report: error: {exc}", file=sys.stderr)
        return 1
    return 0

