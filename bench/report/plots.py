"""Paper-style matplotlib figures (PNG and SVG) from the stages' typed results and files."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import json

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from treesearch.cost import LatencyProfile, predict  # noqa: E402
from treesearch.optimal import model_for, optimal_tree  # noqa: E402
from treesearch.search import objective_value  # noqa: E402
from treesearch.stats import AcceptanceStats  # noqa: E402


def save_figure(fig, out_dir: str | Path, name: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def distinct_colours(n: int) -> list:
    """``n`` colours no two of which are the same: tab10, tab20 up to 20, then evenly spaced on turbo."""
    if n <= 10:
        return [plt.cm.tab10(i) for i in range(n)]
    if n <= 20:
        return [plt.cm.tab20(i) for i in range(n)]
    return [plt.cm.turbo(x) for x in np.linspace(0.03, 0.97, n)]


def plot_acceptance_heatmap(stats: AcceptanceStats, out_dir: str | Path) -> list[Path]:
    """Head x rank acceptance probability (the ``marginal`` matrix)."""
    m = stats.marginal
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * m.shape[1], 1.2 + 0.5 * m.shape[0]))
    im = ax.imshow(m, cmap="viridis", aspect="auto", vmin=0)
    for (j, r), v in np.ndenumerate(m):
        ax.text(r, j, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < m.max() / 2 else "black")
    ax.set_xlabel("rank in head's top-k")
    ax.set_ylabel("Medusa head (proposes token t+j+2)")
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]))
    ax.set_title(f"acceptance by head and rank ({stats.positions or '?'} positions)")
    fig.colorbar(im, ax=ax, label="P(rank-r guess is the emitted token)")
    return save_figure(fig, out_dir, "acceptance_heatmap")


def plot_search(result, stats: AcceptanceStats, latency: LatencyProfile | None, out_dir: str | Path) -> list[Path]:
    """Optimization history, and tau / predicted speed-up of the exact optimum against the budget."""
    written: list[Path] = []
    hist = [h for h in result.history if h["value"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [h["number"] for h in hist]
    ys = [h["value"] for h in hist]
    ax.scatter(xs, ys, s=12, label="trial", color="tab:blue")
    ax.plot(xs, np.maximum.accumulate(ys) if ys else [], color="tab:red", label="best so far")
    for h in hist:
        if h.get("baseline"):
            ax.scatter([h["number"]], [h["value"]], marker="*", s=120, color="black", label=h["baseline"])
    ax.set_xlabel("trial")
    ax.set_ylabel(f"predicted {result.objective}" + (" over plain decoding" if result.objective == "speedup" else ""))
    ax.set_title(f"search history ({len(hist)} trials; Optuna study in the tree file)")
    ax.legend(fontsize=8)
    written += save_figure(fig, out_dir, "search_history")

    model = model_for(stats)
    budgets = sorted(set(np.unique(np.geomspace(1, max(2, result.optimum.tree.num_nodes * 4), 24).astype(int))))
    taus, speeds = [], []
    for b in budgets:
        _, tau = optimal_tree(model, int(b))
        taus.append(tau)
        if latency is not None:
            speeds.append(predict(latency, tau, int(b) + 1).speedup)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(budgets, taus, marker="o", ms=3, label="tau of the exact optimum")
    ax.set_xscale("log")
    ax.set_xlabel("node budget (root excluded)")
    ax.set_ylabel("tau (tokens / step)")
    if speeds:
        ax2 = ax.twinx()
        ax2.plot(budgets, speeds, marker="s", ms=3, color="tab:green", label="predicted speedup")
        ax2.set_ylabel("predicted speedup over plain decoding")
        best = int(np.argmax(speeds))
        ax2.axvline(budgets[best], color="tab:green", ls=":", lw=1)
    ax.set_title("tau and predicted speedup vs tree size")
    fig.legend(fontsize=8, loc="lower right")
    written += save_figure(fig, out_dir, "speedup_vs_budget")
    if result.pareto:
        written += _plot_pareto(result, out_dir)
    return written


def _plot_pareto(result, out_dir: str | Path) -> list[Path]:
    """Typical acceptance: every trial's speed (or tau) against its regret, the Pareto front, the pick."""
    hist = [h for h in result.history if h.get("regret") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.scatter([h["regret"] for h in hist], [h["value"] for h in hist], s=10, color="tab:gray", alpha=0.6,
               label="trial")
    front = result.pareto
    ax.plot([s.regret for s in front], [objective_value(s, result.objective) for s in front], marker="o", ms=4,
            color="tab:red", label="Pareto front")
    best = result.best
    ax.scatter([best.regret], [objective_value(best, result.objective)], marker="*", s=160, color="black",
               label=f"chosen: eps {best.typical.posterior_threshold:.3f}, delta {best.typical.posterior_alpha:.3f}",
               zorder=3)
    ax.set_xlabel("regret: nats per token lost against the base model's own choice")
    ax.set_ylabel(result.objective)
    ax.set_title("typical acceptance: speed against the quality proxy")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "pareto_typical")


def plot_latency(profile: LatencyProfile, out_dir: str | Path) -> list[Path]:
    """Verify-step time against the number of tree nodes, one line per context length."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for ctx, row in zip(profile.contexts, profile.verify_ms):
        ax.plot(profile.nodes, row, marker="o", ms=3, label=f"verify, context {ctx}")
    ax.axhline(float(np.median(profile.plain_ms)), color="black", ls="--", lw=1, label="plain decode step")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes (root included)")
    ax.set_ylabel("median time (ms)")
    dev = profile.meta.get("device", "")
    ax.set_title(f"verify cost on {dev} ({profile.meta.get('dtype', '')})")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "latency_vs_nodes")



def plot_training(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Loss and top-1 accuracy per head over steps, from ``run_dir/training.json`` (plots go to
    ``out_dir``, by default beside it)."""
    rec = json.loads((Path(run_dir) / "training.json").read_text())
    out_dir = out_dir or run_dir
    hist = rec.get("history", [])
    if not hist:
        return []
    steps = [h["step"] for h in hist]
    k = len(hist[0]["top1"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [h["loss"] for h in hist], lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted head loss")
    ax1.set_title(f"{rec.get('method', '')} training loss")
    for j in range(k):
        ys = [h["top1"][j] for h in hist]
        pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
        if pts:
            window = max(1, len(pts) // 20)
            sm = np.convolve([y for _, y in pts], np.ones(window) / window, mode="valid")
            ax2.plot([s for s, _ in pts][window - 1:], sm, lw=1, label=f"head {j} (train)")
    for v in rec.get("validation", []):
        for j, row in enumerate(v["topk"]):
            ax2.scatter([v["step"]], [row[0]], s=14, color=f"C{j}", marker="o")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy (dots: validation)")
    ax2.legend(fontsize=7)
    return save_figure(fig, out_dir, "training_curves")


def plot_learning_curve(curve: dict, out_dir: str | Path) -> list[Path]:
    """Head 0 top-1 and tau@32 (95 % interval) against training tokens (log scale), each with its log-linear
    fit and the release target, from a ``learning_curve.json`` object."""
    rows = curve["points"]
    if not rows:
        return []
    tokens = np.array([r["train_tokens"] for r in rows], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric, label in ((axes[0], "head0_top1", "head 0 top-1"), (axes[1], "tau32", "tau@32 (best 32-node tree)")):
        ys = np.array([r[metric] for r in rows])
        if metric == "tau32":
            lo, hi = np.array([r["tau32_interval"] for r in rows]).T
            ax.errorbar(tokens, ys, yerr=[ys - lo, hi - ys], fmt="o", capsize=3, label="measured")
        else:
            ax.plot(tokens, ys, "o", label="measured")
        fit = curve.get("fits", {}).get(metric, {})
        if fit.get("per_10x") is not None:
            reach = fit.get("tokens_at_target")
            right = max(tokens.max(), min(reach, tokens.max() * 100)) if reach else tokens.max()
            xs = np.geomspace(tokens.min(), right, 50)
            ax.plot(xs, fit["intercept"] + fit["per_10x"] * np.log10(xs), "--", lw=1,
                    label=f"log-linear fit ({fit['per_10x']:+.3f} per 10x)")
        if fit.get("target") is not None:
            ax.axhline(fit["target"], color="grey", lw=0.8, ls=":", label=f"target {fit['target']}")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"learning curve on {curve.get('questions', '')} ({curve.get('eval_tokens', '')} tokens per rollout)",
                 fontsize=9)
    return save_figure(fig, out_dir, "learning_curve")


def plot_typical_measured(front: list[dict], measured: list[dict], out_dir: str | Path) -> list[Path]:
    """The typical search's predicted front (speed-up over plain against regret per token) beside what the
    replay measured for the sampled configurations (``measured``: config, regret, speedup, lo, hi)."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    if front:  # regret of the whole answer: accepted drafts and the sampled tokens (older files: drafts only)
        total = all("total_regret" in p for p in front)
        pts = sorted(front, key=lambda p: p["total_regret" if total else "regret"])
        ax.plot([p["total_regret" if total else "regret"] for p in pts], [p["speedup"] for p in pts], marker="o",
                ms=4, color="tab:gray", label="predicted front (replay of calibration rollouts)"
                + ("" if total else ": drafts' regret only"))
    markers = "sD^v<>ph*"
    for i, m in enumerate(measured):
        ax.errorbar([m["regret"]], [m["speedup"]], yerr=[[m["speedup"] - m["lo"]], [m["hi"] - m["speedup"]]],
                    fmt=markers[i % len(markers)], ms=7, capsize=2,
                    label=f"{m['config']}: {m['speedup']:.2f}x, regret {m['regret']:.3f}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("regret per token (nats: log p_T of the base model's argmax minus that of the token)")
    ax.set_ylabel("speed-up over plain decoding (95 % interval)")
    ax.set_title("sampled configurations: measured speed and quality beside the predicted front")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, out_dir, "typical_measured")


ENGINE_ORDER = ("own", "llama.cpp", "vllm", "transformers")
ENGINE_LABELS = {"own": "this runtime", "llama.cpp": "llama.cpp", "vllm": "vLLM", "transformers": "transformers"}


def headline_rows(rows: list[dict]) -> list[dict]:
    """Per engine, greedy: its plain configurations (no drafts; llama.cpp's on each GGUF) and its fastest
    speculative one; in ENGINE_ORDER, fastest first within an engine. ``rows``: report.json's configurations."""
    greedy = [r for r in rows if not (r.get("temperature") or 0) and r.get("tokens_per_s")]
    out = []
    for engine in ENGINE_ORDER:
        mine = [r for r in greedy if r.get("engine", "own") == engine]
        if engine == "own":
            plain = [r for r in mine if r["config"] == "plain"]
        elif engine == "transformers":
            plain = [r for r in mine if r["config"] == "generate"]
        else:
            plain = [r for r in mine if not r.get("speculative")]
        rest = [r for r in mine if r not in plain]
        best = [max(rest, key=lambda r: r["tokens_per_s"])] if rest else []
        out += sorted(plain + best, key=lambda r: -r["tokens_per_s"])
    return out


def plot_headline(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """The headline: tokens/s of every greedy configuration (batch 1, the same questions), fastest first, with
    its 95 % interval over questions and, where the search predicted it, the predicted tokens/s marked (plain's
    measured tokens/s times the predicted speed-up). One colour per engine."""
    greedy = sorted((r for r in rows if not (r.get("temperature") or 0) and r.get("tokens_per_s")),
                    key=lambda r: -r["tokens_per_s"])
    if not greedy:
        return []
    plain = next((r["tokens_per_s"] for r in greedy if r["config"] == "plain" and r.get("engine", "own") == "own"),
                 None)
    engines = [e for e in ENGINE_ORDER if any(r.get("engine", "own") == e for r in greedy)]
    colour = dict(zip(engines, distinct_colours(len(engines))))
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(greedy) + 1.6))
    y = np.arange(len(greedy))[::-1]
    predicted_shown = False
    for yi, r in zip(y, greedy):
        engine = r.get("engine", "own")
        lo, hi = r.get("tokens_per_s_ci") or (r["tokens_per_s"], r["tokens_per_s"])
        ax.barh(yi, r["tokens_per_s"], color=colour[engine], xerr=[[r["tokens_per_s"] - lo], [hi - r["tokens_per_s"]]],
                capsize=2, error_kw={"lw": 0.8}, edgecolor="black" if r.get("searched") else "none")
        ax.text(max(hi, r["tokens_per_s"]), yi, f"  {r['tokens_per_s']:.0f}", va="center", fontsize=7)
        if plain and r.get("predicted_speedup_vs_plain") is not None:
            ax.plot([plain * r["predicted_speedup_vs_plain"]], [yi], marker="D", ms=5, color="black",
                    label=None if predicted_shown else "predicted (cross-fitted search)", ls="none")
            predicted_shown = True
    for engine in engines:  # one legend entry per engine
        ax.barh([np.nan], [np.nan], color=colour[engine], label=ENGINE_LABELS.get(engine, engine))
    ax.set_yticks(y)
    ax.set_yticklabels([r["config"] for r in greedy], fontsize=7)
    ax.set_xlabel("tokens/s (greedy, batch 1; 95 % interval over questions)")
    ax.set_title("Tokens/s per configuration (outlined: the search's pick)")
    ax.set_xlim(0, max(max(r.get("tokens_per_s_ci") or [0, r["tokens_per_s"]]) for r in greedy) * 1.15)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, out_dir, "tokens_per_s_headline")


def plot_engines_headline(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Tokens/s of every engine's plain and fastest speculative configuration (greedy, batch 1, the same
    questions), 95 % intervals over questions; the runtime's bars in colour, the other engines' in grey."""
    shown = headline_rows(rows)
    if not shown:
        return []
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.4))
    y = np.arange(len(shown))[::-1]
    for yi, r in zip(y, shown):
        own = r.get("engine", "own") == "own"
        lo, hi = r.get("tokens_per_s_ci") or (r["tokens_per_s"], r["tokens_per_s"])
        ax.barh(yi, r["tokens_per_s"], color="tab:red" if own else "0.65", edgecolor="black" if own else "none",
                xerr=[[r["tokens_per_s"] - lo], [hi - r["tokens_per_s"]]], capsize=3, error_kw={"lw": 0.8})
        ax.text(hi, yi, f"  {r['tokens_per_s']:.0f}", va="center", fontsize=8)
    ax.set_yticks(y)
    def label(r: dict) -> str:  # engines' configurations carry the engine's name already
        engine = r.get("engine", "own")
        return r["config"] if r["config"].startswith(engine) else f"{ENGINE_LABELS.get(engine, engine)}: {r['config']}"

    ax.set_yticklabels([label(r) for r in shown], fontsize=8)
    ax.set_xlabel("tokens/s (greedy, batch 1; 95 % interval over questions)")
    ax.set_title("Engines side by side: plain and fastest speculative configuration (red: this runtime)")
    ax.set_xlim(0, max((r.get("tokens_per_s_ci") or [0, r["tokens_per_s"]])[1] for r in shown) * 1.15)
    return save_figure(fig, out_dir, "tokens_per_s_by_engine")
