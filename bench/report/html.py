"""report.html: one self-contained page per bench run (figures embedded as data URIs), what a reader opens.

The page is built from what the stages wrote (``report.json``, the summary tables, ``plots/*.png``,
``command.json``); it needs no network and no files beside it, so it can be mailed or attached as is.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.replay.runner import PEER_METHODS
from bench.report.scorecard import deploy_line, verdict_sentences
from treesearch.fsutil import atomic_file


@dataclass(frozen=True)
class Figure:
    name: str  # plots/<name>.png
    title: str
    caption: str  # what the figure shows; the run's model and machine are appended


FIGURES = (
    Figure("tokens_per_s_headline", "Tokens/s per configuration",
           "Every greedy configuration, batch 1, on the same questions, fastest first; whiskers: 95 % bootstrap "
           "interval over the questions; diamonds: the tokens/s the search predicted (plain decoding's measured "
           "tokens/s times the cross-fitted predicted speed-up); outlined: the search's pick. One colour per engine."),
    Figure("tokens_per_s_by_engine", "Engines side by side",
           "Tokens/s of each engine's plain decoding and its fastest speculative configuration on the same questions, "
           "greedy, batch 1, the same chat template and new-token budget, interleaved question by question (the "
           "engines' start-up excluded); whiskers: 95 % bootstrap interval over the questions. Red: this runtime."),
    Figure("speedup_by_category_vs_plain", "Speed-up per category over the runtime's plain decoding",
           "Tokens/s of each configuration over plain decoding in the same engine (the paper's baseline), per "
           "question category and overall; whiskers: 95 % paired bootstrap interval over the questions. The Medusa "
           "paper's figures (another model and machine) are in a table above, not on this chart."),
    Figure("speedup_by_category_vs_generate", "Speed-up per category over transformers generate",
           "Tokens/s over transformers' own greedy generate on the same model, dtype and threads."),
    Figure("tau_by_category", "Accepted length per category",
           "tau: tokens committed per decode step (1.0 for plain decoding), per category, for the Medusa "
           "configurations."),
    Figure("predicted_vs_measured", "Predictions against measurements",
           "Each predicted configuration's measured speed-up over plain (95 % interval over questions) against "
           "the search's cross-fitted prediction; the band is +-5 %; the star is the search's pick."),
    Figure("speedup_vs_quality", "Speed against quality",
           "Overall speed-up over plain decoding against the quality figure the run has: the judge's mean score "
           "where a judge graded the answers, else the share of greedy outputs identical to the runtime's plain "
           "decoding (the lossless check; a proxy, not a judge score)."),
    Figure("typical_measured", "Sampled configurations: measured against predicted",
           "At the typical search's temperature, on the peer questions (two seeded samples per question): plain "
           "sampling, exact tree sampling and typical acceptance at three points of the predicted front; x: regret "
           "per token measured on the answers under the base model, y: speed-up over greedy plain decoding with a "
           "95 % paired interval; grey: the front the search predicted from calibration rollouts."),
    Figure("acceptance_heatmap", "Head acceptance",
           "Calibration: how often head k's rank-r candidate is the token the base model then chose."),
    Figure("latency_vs_nodes", "Step latency against tree size",
           "Latency profile: one verify forward of a tree of N nodes at each profiled context length (ms)."),
    Figure("pareto_typical", "Typical acceptance: speed against regret",
           "Trees and thresholds searched for typical acceptance: predicted speed-up against the predicted "
           "regret (nats/token of the base model's log-likelihood given up)."),
    Figure("search_history", "Search history", "The typical-acceptance search's trials: predicted speed-up over "
           "plain decoding per trial, the best so far, and the official mc_sim_7b_63 tree as a baseline trial."),
    Figure("speedup_vs_budget", "Speed-up against tree budget", "Best predicted speed-up per tree-size budget."),
    Figure("training_curves", "Training of this run's heads (--retrain)", "Loss and head-0 accuracy over training steps."),
)

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; } th { background: #f2f2f2; }
td:first-child, th:first-child { text-align: left; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #444; max-width: 900px; }
.meta td { text-align: left; } .note { background: #fff8e0; padding: 0.5em 1em; border-left: 4px solid #e0b000; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value))


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"data:image/png;base64,{data}"


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, na_rep="-", float_format=lambda v: f"{v:.3f}", escape=True)


def _meta_table(rows: Sequence[tuple[str, object]]) -> str:
    cells = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows if v not in (None, ""))
    return f'<table class="meta">{cells}</table>'


def _run_meta(out: Path, report: dict, records_meta: dict) -> list[tuple[str, object]]:
    machine = report.get("machine") or {}
    versions = report.get("versions") or records_meta.get("versions") or {}
    command = json.loads((out / "command.json").read_text()) if (out / "command.json").is_file() else {}
    return [("command", command.get("command")), ("model", records_meta.get("model")),
            ("heads", records_meta.get("heads")), ("dtype", records_meta.get("dtype")),
            ("device", records_meta.get("device")),
            ("machine", ", ".join(f"{k} {v}" for k, v in machine.items()) if machine else None),
            ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()) if versions else None),
            ("report written", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))]


def _figure_context(records_meta: dict, report: dict) -> str:
    machine = report.get("machine") or {}
    where = machine.get("cpu_model") or machine.get("processor") or "this machine"
    threads = machine.get("torch_threads")
    return (f" Model {records_meta.get('model', '?')}, {records_meta.get('dtype', '?')} on "
            f"{records_meta.get('device', '?')} ({where}{f', {threads} threads' if threads else ''}).")


def _verdict(report: dict) -> str:
    v = report.get("verdict") or {}
    if not v:
        return "<p>No predictions in this run (no workload file): measured figures only.</p>"

    items = verdict_sentences(v, strong=lambda text: f"<b>{text}</b>", esc=_esc)
    if report.get("deploy"):
        items.append(_esc(deploy_line(report["deploy"])))
    return "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def _configs_table(report: dict) -> str:
    rows = report.get("configs") or []
    if not rows:
        return ""
    df = pd.DataFrame(rows)
    def count(v):  # a count as an integer; the folds' picks may differ: then their sorted list, as a range
        if isinstance(v, list):
            return f"{min(v):g}-{max(v):g}"
        return "-" if v is None or v != v else f"{v:g}"

    for col in ("lookup", "tree_nodes"):
        if col in df:
            df[col] = df[col].map(count)
    for col in ("speedup_vs_plain_ci", "tau_ci", "predicted_tau_ci"):
        if col in df:
            df[col] = df[col].map(lambda c: f"{c[0]:.3f}-{c[1]:.3f}" if isinstance(c, list) else "-")
    cols = [c for c in ("config", "engine", "lookup", "tree_nodes", "accept", "tokens_per_s", "tau", "predicted_tau",
                        "speedup_vs_plain", "speedup_vs_plain_ci", "predicted_speedup_vs_plain", "searched",
                        "identical_to_plain") if c in df]
    return "<h2>Configurations: measured and predicted</h2>" + _table(df[cols]) + _engines_table(df)


def _engines_table(df: pd.DataFrame) -> str:
    """The engines' own counters: drafts accepted per chain position (measured by the engine, predicted by the
    suite), the share of drafted tokens accepted, and each engine's start-up."""
    if "engine" not in df or not df["engine"].isin(PEER_METHODS).any():
        return ""
    rows = df[df["engine"].isin(PEER_METHODS)].copy()

    def vec(v):
        return " / ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else "-"

    for col in ("accepted_per_position", "predicted_accepted_per_position"):
        rows[col] = rows[col].map(vec) if col in rows else "-"
    cols = [c for c in ("config", "weights", "speculative", "draft_tokens", "tokens_per_s", "draft_acceptance",
                        "accepted_per_position", "predicted_accepted_per_position", "startup_s") if c in rows]
    return ("<h3>Engines: their own counters</h3><p>accepted per position: the engine's count of drafting steps "
            "that accepted chain position 1, 2, ... over its drafting steps; predicted: the suite's calibration of the "
            "same heads on the same questions. Start-up (s) is excluded from tokens/s.</p>" + _table(rows[cols]))


def _ll_table(quality: dict | None) -> str:
    rows = [{"config": cfg, "temperature": q.get("temperature"), "log-likelihood per token": q["log_likelihood_per_token"],
             "regret per token": q.get("regret_per_token"), "answers": q.get("answers"), "tokens": q["tokens"]}
            for cfg, q in ((quality or {}).get("configs") or {}).items()]
    if not rows:
        return ""
    checks = [c for c in (quality or {}).get("distribution_checks", []) if c.get("p_value") is not None]
    lines = "".join(f"<li><b>{_esc(c['config'])}</b> against {_esc(c['reference'])}: mean difference "
                    f"{c['mean_difference']:+.4f} nats/token over {c['questions']} questions, p = {c['p_value']:.3f} "
                    f"(sign-flip permutation test); it detects a shift of {c['detectable_at_80_power']:.3f} "
                    "nats/token with 80 % power: "
                    + ("<b>indistinguishable</b>" if c["indistinguishable"] else "<b>different</b>") + ".</li>"
                    for c in checks)
    return ("<p>Under the base model (proxies): mean log-likelihood per answer token, and regret per token (log "
            "p<sub>T</sub> of the base model's own argmax minus that of the token, at the configuration's "
            "temperature: about 0 for greedy decoding, where the runtime's bfloat16 forward and transformers' round a "
            "few near-ties differently). Every greedy configuration of the runtime shares plain decoding's "
            "answers.</p>" + _table(pd.DataFrame(rows))
            + (f"<p>Exact tree sampling against plain sampling:</p><ul>{lines}</ul>" if lines else ""))


def _quality(judge: dict | None, quality: dict | None) -> str:
    if not judge:
        return ("<h2>Quality</h2><p class=\"note\">No judge in this run (<code>--judge MODEL</code> adds one). "
                "Shown instead are proxies, labelled as proxies: the share of greedy outputs identical to the "
                "runtime's plain decoding (the lossless check), to transformers generate (a numerics note), and "
                "the log-likelihood below.</p>" + _ll_table(quality))
    rows, cats = [], []
    for cfg, c in judge["configs"].items():
        rows.append({"config": cfg, "score": c["score"], **{f"turn {t}": v for t, v in c["by_turn"].items()},
                     "judgments": c["judgments"], "unparsable": c["unparsable"], "guided": c.get("guided", 0)})
        cats.append({"config": cfg, **c["by_category"]})
    bad = sum(c["unparsable"] for c in judge["configs"].values())
    total = sum(c["judgments"] for c in judge["configs"].values())
    guided = sum(c.get("guided", 0) for c in judge["configs"].values())
    how = (f" {guided} of {total} ratings came from a follow-up turn constrained to 1-10 (the judgment had no "
           "[[rating]]; not FastChat's rule)." if guided else "")
    note = (f"<p>Judge <b>{_esc(judge['judge'])}</b>, FastChat single grading (1-10; math, reasoning and coding "
            f"against the reference answers).{how} {bad} of {total} ratings unparsable, left out of the means as "
            "FastChat's show_result does" + (f"; {judge['skipped_no_reference']} answers not graded (their category "
                                               "needs a reference answer the question set lacks)"
                                               if judge.get("skipped_no_reference") else "") + ".</p>")
    return ("<h2>Quality: judge scores</h2>" + note + _table(pd.DataFrame(rows)) + "<h3>Per category</h3>"
            + _table(pd.DataFrame(cats)) + _ll_table(quality))


def write_html(out: Path, tables: dict[str, pd.DataFrame], records_meta: dict, judge: dict | None = None,
               quality: dict | None = None) -> Path:
    """Write ``out/report.html`` from the run's files, the summary ``tables`` (title -> frame), the judge's
    scores (judge_scores.json) and the log-likelihood proxy (quality.json) where the run has them."""
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    context = _figure_context(records_meta, report)
    parts = [f"<h1>Medusa bench report: {_esc(out.name)}</h1>", _meta_table(_run_meta(out, report, records_meta)),
             "<h2>Verdict</h2>", _verdict(report), _configs_table(report), _quality(judge, quality)]
    for title, df in tables.items():
        parts += [f"<h2>{_esc(title)}</h2>", _table(df)]
    parts.append("<h2>Figures</h2>")
    for fig in FIGURES:
        png = out / "plots" / f"{fig.name}.png"
        if png.is_file():
            parts.append(f'<figure id="{fig.name}"><img alt="{_esc(fig.title)}" src="{_image(png)}">'
                         f"<figcaption><b>{_esc(fig.title)}.</b> {_esc(fig.caption + context)}</figcaption></figure>")
    page = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Medusa bench report</title>"
            f"<style>{_STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>\n")
    path = out / "report.html"
    with atomic_file(path) as tmp:
        Path(tmp).write_text(page)
    return path
