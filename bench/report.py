"""Report of a bench run: summary table and paper-style plots from the files the stages wrote."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from bench.analyze import greedy_equality, records_frame, summary, to_markdown  # noqa: E402
from bench.mtbench import CATEGORIES  # noqa: E402
from bench.plots import _save  # noqa: E402
from bench.runner import load_records  # noqa: E402

PAPER_OVERALL = {"Medusa-1 (paper, Vicuna-7B, GPU)": 2.18, "Medusa-2 (paper, Vicuna-7B, GPU)": 2.83}


def plot_speedup_by_category(table: pd.DataFrame, baseline: str, out_dir: Path) -> list[Path]:
    """Figure-3 layout: grouped bars, one group per MT-Bench category, one bar per configuration."""
    col = f"speedup_vs_{baseline}"
    configs = [c for c in table["config"].unique() if c != baseline]
    cats = [c for c in CATEGORIES if c in set(table["category"])] + ["overall"]
    fig, ax = plt.subplots(figsize=(13, 4))
    width = 0.8 / max(1, len(configs))
    for i, cfg in enumerate(configs):
        sub = table[table["config"] == cfg].set_index("category")[col]
        ax.bar(np.arange(len(cats)) + i * width, [sub.get(c, np.nan) for c in cats], width, label=cfg)
    for j, (label, value) in enumerate(PAPER_OVERALL.items()):
        ax.axhline(value, color="grey", ls=[":", "--"][j % 2], lw=1, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(cats)) + width * (len(configs) - 1) / 2)
    ax.set_xticklabels(cats, rotation=20)
    ax.set_ylabel(f"speedup over {baseline}")
    ax.set_title("speedup per MT-Bench category (tokens/s ratio)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no bar hidden
    return _save(fig, out_dir, f"speedup_by_category_vs_{baseline}")


def plot_tau_by_category(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    medusa = [c for c in table["config"].unique() if c.startswith("medusa")]
    cats = [c for c in CATEGORIES if c in set(table["category"])] + ["overall"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    width = 0.8 / max(1, len(medusa))
    for i, cfg in enumerate(medusa):
        sub = table[table["config"] == cfg].set_index("category")["tau"]
        ax.bar(np.arange(len(cats)) + i * width, [sub.get(c, np.nan) for c in cats], width, label=cfg)
    ax.set_xticks(np.arange(len(cats)) + width * (len(medusa) - 1) / 2)
    ax.set_xticklabels(cats, rotation=20)
    ax.set_ylabel("tau (tokens per step)")
    ax.set_title("accepted length per MT-Bench category")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "tau_by_category")


def plot_speedup_vs_quality(table: pd.DataFrame, eq: pd.DataFrame, baseline: str, out_dir: Path) -> list[Path]:
    """Speed against a judge-free quality proxy: share of outputs identical to the baseline's."""
    overall = table[table["category"] == "overall"].set_index("config")
    fig, ax = plt.subplots(figsize=(6, 4))
    for _, row in eq.iterrows():
        if row["config"] in overall.index:
            x = overall.loc[row["config"], f"speedup_vs_{baseline}"]
            ax.scatter([x], [row["identical_share"]], s=40)
            ax.annotate(row["config"], (x, row["identical_share"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xlabel(f"speedup over {baseline}")
    ax.set_ylabel(f"outputs identical to {baseline} (quality proxy)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("speed vs quality proxy (no judge)")
    return _save(fig, out_dir, "speedup_vs_quality")


def _stage_inputs(out: Path):
    """(acceptance statistics, latency profile, replay configurations) of a bench run, or None when one
    of their files is missing (a replay run outside the pipeline)."""
    from treesearch.cost import load_profile
    from treesearch.stats import load_stats

    acc, lat, cfg_file = out / "acceptance.json", out / "latency.json", out / "replay_config.json"
    if not (acc.is_file() and lat.is_file() and cfg_file.is_file()):
        return None
    return load_stats(acc), load_profile(lat), json.loads(cfg_file.read_text())["configurations"]


def plot_measured_vs_predicted(table: pd.DataFrame, out: Path, plots: Path) -> list[Path]:
    """Measured speed-up (over plain) of each replayed tree against the cost model's curve."""
    from treesearch.cost import predict
    from treesearch.optimal import model_for, optimal_tree
    from treesearch.tree import load_tree

    inputs = _stage_inputs(out)
    if inputs is None:
        return []
    stats, prof, configs = inputs
    model = model_for(stats)
    budgets = sorted(set(np.geomspace(1, 256, 28).astype(int)))
    curve = [predict(prof, optimal_tree(model, int(b))[1], int(b) + 1).speedup for b in budgets]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([b + 1 for b in budgets], curve, color="tab:green", label="predicted (exact optimum + cost model)")
    overall = table[table["category"] == "overall"].set_index("config")
    for c in configs:
        if c["method"] == "medusa" and c["name"] in overall.index:
            n = load_tree(c["tree"]).num_nodes
            ax.scatter([n], [overall.loc[c["name"], "speedup_vs_plain"]], s=40, label=f"measured: {c['name']}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("tree nodes (root included)")
    ax.set_ylabel("speedup over the runtime's plain decoding")
    ax.set_title("speedup vs tree size")
    ax.legend(fontsize=7)
    return _save(fig, plots, "speedup_vs_tree_size")


def report(out: Path) -> list[Path]:
    plots = out / "plots"
    records = load_records(out / "replay" / "records.jsonl")
    df = records_frame(records)
    table = summary(df, ["generate", "plain"])
    eq = greedy_equality(df, "generate")
    # in bf16 the runtime's C forward rounds its own way (not as transformers does): Medusa's exactness
    # shows against the runtime's plain decoding
    to_plain = greedy_equality(df, "plain")[["config", "identical"]].rename(columns={"identical": "identical_to_plain"})
    eq_both = eq.merge(to_plain, on="config", how="left")
    written: list[Path] = []
    written += plot_speedup_by_category(table, "generate", plots)
    written += plot_speedup_by_category(table, "plain", plots)
    written += plot_tau_by_category(table, plots)
    written += plot_speedup_vs_quality(table, eq, "generate", plots)
    written += plot_measured_vs_predicted(table, out, plots)
    shipped = _training_json()
    if shipped is not None:
        from bench.plots import plot_training

        written += plot_training(shipped.parent, plots)
    overall = table[table["category"] == "overall"][["config", "tokens", "seconds", "tokens_per_s", "tau",
                                                       "speedup_vs_generate", "speedup_vs_plain"]]
    md = ("## Overall\n\n" + to_markdown(overall) + "\n\n## Speedup over transformers generate, per category\n\n"
          + to_markdown(table.pivot(index="category", columns="config", values="speedup_vs_generate").reset_index())
          + "\n\n## Greedy outputs identical to generate (identical) and to the runtime's plain decoding "
            "(identical_to_plain)\n\n" + to_markdown(eq_both) + "\n" + tree_section(table, out)
          + typical_section(out))
    (out / "summary.md").write_text(md)
    print(md)
    return [out / "summary.md", *[p for p in written if p.suffix == ".png"]]


def tree_section(table: pd.DataFrame, out: Path) -> str:
    """The searched tree against every chain and mc_sim_7b_63, measured in the same replay, beside what the
    acceptance statistics (replay on the calibration rollouts) and the latency profile predicted."""
    from treesearch.cost import predict
    from treesearch.stats import tau_step_walk
    from treesearch.tree import load_tree

    inputs = _stage_inputs(out)
    if inputs is None:
        return ""
    stats, prof, configs = inputs
    overall = table[table["category"] == "overall"].set_index("config")
    rows = []
    for c in configs:
        if c["method"] != "medusa" or c.get("lookup_tokens") or c["name"] not in overall.index:
            continue
        tree = load_tree(c["tree"])
        tau = tau_step_walk(tree, stats.rollouts).tau
        m = overall.loc[c["name"]]
        rows.append({"config": c["name"], "nodes": tree.num_nodes, "predicted_tau": tau,
                     "predicted_speedup_vs_plain": predict(prof, tau, tree.num_nodes).speedup,
                     "tau": m["tau"], "tokens_per_s": m["tokens_per_s"], "speedup_vs_plain": m["speedup_vs_plain"]})
    if not rows:
        return ""
    frame = pd.DataFrame(rows)
    chains = frame[frame["config"].str.startswith("medusa chain:")]
    searched = frame[frame["config"] == "medusa searched"]
    if chains.empty or searched.empty:
        return ""
    best = chains.loc[chains["tokens_per_s"].idxmax()]
    speed = float(searched["tokens_per_s"].iloc[0])
    verdict = (f"Searched tree {speed:.2f} tokens/s; best measured chain ({best['config'].removeprefix('medusa ')}) "
               f"{best['tokens_per_s']:.2f}: ratio {speed / best['tokens_per_s']:.3f}")
    mc = frame[frame["config"] == "medusa mc_sim_7b_63"]
    if not mc.empty:
        verdict += f"; mc_sim_7b_63 {mc['tokens_per_s'].iloc[0]:.2f}: ratio {speed / mc['tokens_per_s'].iloc[0]:.3f}"
    return ("\n## Trees: predicted (calibration replay + latency profile) and measured (this replay)\n\n"
            + to_markdown(frame.round(3)) + "\n\n" + verdict + ".\n")


def typical_section(out: Path) -> str:
    """The typical-acceptance search's Pareto front (predicted by replay, not measured)."""
    f = out / "tree-typical.json"
    if not f.is_file():
        return ""
    acc = json.loads(f.read_text()).get("acceptance") or {}
    front = pd.DataFrame([{"nodes": len(p["medusa_choices"]), "epsilon": p["posterior_threshold"],
                           "delta": p["posterior_alpha"], "tau": p["tau"], "predicted_speedup": p["speedup"],
                           "regret_nats_per_token": p["regret"]} for p in acc.get("pareto", [])])
    if front.empty:
        return ""
    return (f"\n## Typical acceptance at temperature {acc['temperature']} (replayed, predicted)\n\n"
            f"Chosen (fastest within {acc['max_regret']} nats/token of regret): epsilon "
            f"{acc['posterior_threshold']:.4f}, delta {acc['posterior_alpha']:.4f}, regret "
            f"{acc['predicted_regret']:.4f}. Pareto front:\n\n" + to_markdown(front.round(4)) + "\n")


def _training_json() -> Path | None:
    from medusa_runtime.heads import shipped_heads_dir

    d = shipped_heads_dir()
    if d is None:
        return None
    f = d.parent / "training.json"
    return f if f.is_file() else None
