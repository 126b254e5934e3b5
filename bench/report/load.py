"""The report's load section: load.json (the bench under concurrency) as a table, two charts and sentences.

    throughput_vs_concurrency : output tokens/s of every (configuration, engine) against the concurrency, each a
                                line with its 95 % interval as a band
    speedup_vs_concurrency    : each Medusa configuration's speed-up over the same server's plain decoding at equal
                                concurrency, with its interval; the line at 1 is where it stops paying

The row that follows tree.json's schedule (``schedule``) is drawn bold with star markers, its predicted
throughput dashed beside the measured one, and the section puts the two side by side per concurrency.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from bench.replay.analyze import to_markdown
from bench.report.plots import distinct_colours, plt, save_figure


def read_load(out: Path) -> dict | None:
    path = out / "load.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_frame(doc: dict) -> pd.DataFrame:
    """The fixed-concurrency rows: one per (configuration, engine, concurrency)."""
    rows = [r for r in doc.get("rows", []) if r.get("concurrency") and "output_tokens_per_s" in r]
    return pd.DataFrame([{"config": r["config"], "engine": r["engine"], "concurrency": r["concurrency"],
                          "tokens_per_s": r["output_tokens_per_s"], "lo": r["output_tokens_per_s_ci"][0],
                          "hi": r["output_tokens_per_s_ci"][1], "speedup": r.get("speedup_vs_plain"),
                          "speedup_lo": (r.get("speedup_vs_plain_ci") or [None, None])[0],
                          "speedup_hi": (r.get("speedup_vs_plain_ci") or [None, None])[1],
                          "speedup_heads_base": r.get("speedup_vs_heads_base_plain"),
                          "ttft_p50_ms": (r.get("ttft_ms") or {}).get("p50"),
                          "tpot_p50_ms": (r.get("tpot_ms") or {}).get("p50"),
                          "accepted_per_step": r.get("accepted_per_step"),
                          "identical_to_plain": r.get("identical_to_plain"), "build": r.get("build"),
                          "schedule": bool(r.get("schedule")), "predicted": r.get("predicted_output_tokens_per_s"),
                          "predicted_at_search": r.get("predicted_output_tokens_per_s_at_search"),
                          "runs": (r.get("schedule_range") or {}).get("config"),
                          "runs_batch": (r.get("schedule_range") or {}).get("batch"),
                          "same_as": (r.get("schedule_range") or {}).get("same_as")}
                         for r in rows])


def prediction_sentences(df: pd.DataFrame) -> list[str]:
    """The schedule's predicted against measured throughput, per concurrency, and the schedule against plain
    decoding (on either base) and the fastest fixed configuration of the runtime measured there."""
    if df.empty:
        return []
    rows = df[df["schedule"] & df["predicted"].notna()].sort_values("concurrency")
    out = []
    for r in rows.itertuples():
        line = (f"schedule at concurrency {r.concurrency}{_runs(r)}: predicted {r.predicted:.1f} output tokens/s, "
                f"measured {r.tokens_per_s:.1f} ({r.tokens_per_s / r.predicted:.3f}x the prediction")
        if pd.notna(r.predicted_at_search):  # priced with steps timed during the load; beside it, the search's
            line += f"; {r.tokens_per_s / r.predicted_at_search:.3f}x it at the search's step costs"
        line += ")"
        if pd.notna(r.speedup):
            line += f"; {r.speedup:.3f}x plain decoding"
        if pd.notna(r.speedup_heads_base):
            line += f", {r.speedup_heads_base:.3f}x plain decoding on the heads' base"
        fixed = df[(df["engine"] == r.engine) & (df["concurrency"] == r.concurrency) & ~df["schedule"]
                   & ~df["config"].str.startswith("plain")]
        if not fixed.empty:
            best = fixed.loc[fixed["tokens_per_s"].idxmax()]
            line += f"; {r.tokens_per_s / best['tokens_per_s']:.3f}x the fastest fixed configuration ({best['config']})"
        out.append(line + "." + _same_decoding(df, r))
    return out


def _runs(r) -> str:
    """What the schedule runs at that concurrency's batch size, in words ("" where load.json does not say)."""
    if not isinstance(r.runs, str):
        return ""
    first, last = r.runs_batch
    return f" (runs {r.runs} at batch sizes {first}-{last})"


def _same_decoding(df: pd.DataFrame, r) -> str:
    """Where the schedule runs plain decoding, the row that decodes the same way, its interval beside the
    schedule's: two servers doing the same work, measured one after the other."""
    if not isinstance(r.same_as, str):
        return ""
    same = df[(df["engine"] == r.engine) & (df["concurrency"] == r.concurrency) & (df["config"] == r.same_as)]
    if same.empty:
        return ""
    o = same.iloc[0]
    overlap = "overlap" if r.lo <= o["hi"] and o["lo"] <= r.hi else "do not overlap"
    return (f" There it decodes as the {r.same_as} row does: {r.tokens_per_s:.1f} [{r.lo:.1f}, {r.hi:.1f}] against "
            f"{o['tokens_per_s']:.1f} [{o['lo']:.1f}, {o['hi']:.1f}] output tokens/s, the intervals {overlap}.")


def stop_sentences(doc: dict) -> list[str]:
    """Where each configuration stops paying, in words."""
    out = []
    for config, s in (doc.get("stops_paying") or {}).items():
        at = s.get("stops_paying_at")
        if at is None:
            out.append(f"{config} pays at every concurrency measured ({', '.join(map(str, doc['concurrencies']))}).")
        else:
            sure = "its interval lies below 1" if s.get("certain") else "its interval still reaches 1"
            line = f"{config} stops paying at concurrency {at}: slower than plain decoding there ({sure})"
            runs = next((r.get("schedule_range") for r in doc.get("rows", []) if r.get("config") == config
                         and r.get("engine") == s.get("engine") and r.get("concurrency") == at), None)
            if runs and runs.get("same_as"):  # the schedule's own choice there: plain decoding
                line += f", where it runs {runs['config']}, the {runs['same_as']} row's decoding"
            out.append(line + ".")
    return out


def _lines(ax, frame: pd.DataFrame, colours: dict, y: str, lo: str, hi: str, engine_in_label: bool) -> None:
    """One line per (configuration, engine) with its interval as a band; the schedule's bold with stars."""
    for key in sorted({(c, e) for c, e in zip(frame["config"], frame["engine"])}):
        part = frame[(frame["config"] == key[0]) & (frame["engine"] == key[1])].sort_values("concurrency")
        scheduled = bool(part["schedule"].any())
        label = f"{key[0]} ({key[1]})" if engine_in_label else key[0]
        ax.plot(part["concurrency"], part[y], "*-" if scheduled else "o-", color=colours[key], lw=2.5 if scheduled
                else 1.5, ms=10 if scheduled else 5, label=label + (" = tree.json's schedule" if scheduled else ""))
        ax.fill_between(part["concurrency"], part[lo], part[hi], color=colours[key], alpha=0.2)
        if scheduled and y == "tokens_per_s" and part["predicted"].notna().any():
            ax.plot(part["concurrency"], part["predicted"], "--", color=colours[key], lw=1.5,
                    label=f"{key[0]}: predicted by the search")


def _axes(ax, ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot_load(df: pd.DataFrame, plots: Path) -> list[Path]:
    if df.empty:
        return []
    lines = sorted({(c, e) for c, e in zip(df["config"], df["engine"])})
    colours = dict(zip(lines, distinct_colours(len(lines))))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _lines(ax, df, colours, "tokens_per_s", "lo", "hi", engine_in_label=True)
    _axes(ax, "output tokens/s, all requests (95 % interval)", "throughput under load")
    written = save_figure(fig, plots, "throughput_vs_concurrency")
    medusa = df[df["speedup"].notna()]
    if not medusa.empty:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _lines(ax, medusa, colours, "speedup", "speedup_lo", "speedup_hi", engine_in_label=False)
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        _axes(ax, "speed-up over plain decoding (95 % interval)",
              "Medusa's speed-up at equal concurrency (below 1: it stops paying)")
        written += save_figure(fig, plots, "speedup_vs_concurrency")
    return written


def load_section(out: Path, plots: Path) -> tuple[str, dict | None, list[Path]]:
    """(summary.md's section, report.json's ``load``, the figures) of a run with a load.json, else ("", None, [])."""
    doc = read_load(out)
    if doc is None:
        return "", None, []
    df = load_frame(doc)
    section = "\n## Under load (load.json)\n\n"
    section += (to_markdown(df.drop(columns=["lo", "hi", "speedup_lo", "speedup_hi"]).round(3)) if not df.empty
                else "(no rows)")
    basis = [f"The schedule's predictions are for {doc['schedule_predicted_for']}."] \
        if doc.get("schedule_predicted_for") and prediction_sentences(df) else []
    section += "\n\n" + "\n".join(stop_sentences(doc) + basis + prediction_sentences(df)
                                   + [f"Left out: {x}" for x in doc.get("left_out", [])]) + "\n"
    summary = {k: doc.get(k) for k in ("concurrencies", "rates", "questions", "max_new_tokens", "rows",
                                       "stops_paying", "left_out", "schedule_predicted_for")}
    return section, summary, plot_load(df, plots)
