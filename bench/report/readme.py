"""Refresh the README's results table, ``docs/results.md`` and the figures under ``docs/`` from a bench run.

    python -m bench.report.readme [--results results/bench] [--readme README.md] [--docs docs]

The compact table between the README's ``bench-results`` markers (the run's machine and date, tokens/s, tau and
speed-up per configuration, then the verdict) and ``docs/results.md`` (every column, the verdict, the figures) are
rendered from ``report.json`` (never typed by hand; the verdict in the scorecard's own sentences,
``verdict_sentences``), and the figures are copied from the run's ``plots/``, so all of them always describe the
same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench.replay.runner import PEER_METHODS
from bench.report.scorecard import verdict_sentences

BEGIN, END = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"
FIGURES = ("predicted_vs_measured.png", "pareto_typical.png", "tokens_per_s_by_engine.png")
FIGURE_TEXT = {"tokens_per_s_by_engine.png": "every engine's plain and fastest speculative configuration, tokens/s with "
                                             "95 % intervals",
               "predicted_vs_measured.png": "each configuration's measured speed-up against the search's prediction"}
ENGINE_NAMES = {"own": "this runtime", "transformers": "transformers", "vllm": "vLLM", "llama.cpp": "llama.cpp"}


def _num(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _setting(v) -> str:
    """A configuration's setting for the table: '-' for none, 'a-b' where the folds' picks differ."""
    if v is None or v == 0:
        return "-"
    if isinstance(v, float) and v.is_integer():  # counts come back from JSON as floats where a column had NaN
        v = int(v)
    return f"{min(v)}-{max(v)}" if isinstance(v, list) else str(v)


def medusa_bound_line(medusa: list[dict]) -> str:
    """What bounds vLLM + Medusa over vLLM plain, measured: its best chain's speed-up is its tau over what one
    of its steps costs in plain steps; the tau a 1.2x would need at that cost."""
    rows = [c for c in medusa if c.get("speedup_vs_engine_plain") and c.get("step_cost_vs_engine_plain")]
    if not rows:
        return ""
    best = max(rows, key=lambda c: c["speedup_vs_engine_plain"])
    ci = best.get("speedup_vs_engine_plain_ci") or [None, None]
    costs = ", ".join(f"{c['step_cost_vs_engine_plain']:.2f}" for c in rows)
    return (f"vLLM + Medusa against vLLM plain: best {best['config']}, {best['speedup_vs_engine_plain']:.2f}x "
            f"({_num(ci[0])}-{_num(ci[1])}) = tau {best['tau']:.2f} / a step costing "
            f"{best['step_cost_vs_engine_plain']:.2f} plain steps (chains 1-{len(rows)}: {costs}); 1.2x at that "
            f"cost needs tau {1.2 * best['step_cost_vs_engine_plain']:.2f}.")


def _run_line(report: dict) -> str:
    """Which session ran, on what machine, when."""
    m = report.get("machine", {})
    engines = any(c.get("engine") in PEER_METHODS for c in report["configs"])
    return (f"`nox -s {'engines' if engines else 'bench'}` on {m.get('cpu_model') or m.get('processor', '?')} "
            f"({m.get('cpu_count', '?')} cores), {report.get('created', '?')[:10]}")


def render_compact(report: dict) -> str:
    """The README's table: the run's machine and date, then per configuration its engine, tokens/s, tau and
    speed-up over the runtime's plain decoding with its interval."""
    lines = [_run_line(report) + ":", "",
             "| configuration | engine | tokens/s | tau | speed-up vs plain (95 %) |", "|---|---|---:|---:|---:|"]
    for c in report["configs"]:
        ci = c.get("speedup_vs_plain_ci") or [None, None]
        name = f"**{c['config']}**" if c.get("searched") else c["config"]
        engine = ENGINE_NAMES.get(c.get("engine") or "own", c.get("engine"))
        lines.append(f"| {name} | {engine} | {_num(c.get('tokens_per_s'), '.1f')} | {_num(c.get('tau'))} | "
                     f"{_num(c.get('speedup_vs_plain'))}x ({_num(ci[0])}-{_num(ci[1])}) |")
    if report.get("verdict"):
        lines += ["", " ".join(verdict_sentences(report["verdict"], strong=_bold))]
    return "\n".join(lines)


def _bold(text: str) -> str:
    return f"**{text}**"


def render(report: dict) -> str:
    """Markdown: one row per configuration, measured beside predicted, then the verdict in the scorecard's sentences
    and what the engines' counters and the distribution checks add."""
    q = report.get("questions", {})
    m = report.get("machine", {})
    v = report.get("verdict", {})
    engines = any(c.get("engine") in PEER_METHODS for c in report["configs"])
    lines = [f"`nox -s {'engines' if engines else 'bench'}` on {m.get('cpu_model') or m.get('processor', '?')} ({m.get('cpu_count', '?')} cores; decode steps on the C "
             f"forward: {m.get('lean_c_forward', '?')}), {report.get('created', '?')[:10]}: "
             f"{q.get('questions', '?')}, {len(q.get('replayed', []))} questions replayed in {len(q.get('folds', []))} "
             f"folds ({q.get('max_new_tokens', '?')} new tokens, bf16), calibrated on {q.get('calibration', '?')}.",
             "",
             "| configuration | engine | decoding | tree nodes | lookup | questions | tokens/s | tau | predicted tau | "
             "speed-up vs plain (95 %) | predicted | outputs = plain |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report["configs"]:
        ci = c.get("speedup_vs_plain_ci") or [None, None]
        name = f"**{c['config']}**" if c.get("searched") else c["config"]
        same = c.get("identical_to_plain")
        t = c.get("temperature") or 0
        decoding = c.get("accept") or "greedy"
        decoding += f", T {t:g}" if t else ""
        decoding += f", {c['speculative']} {_setting(c.get('draft_tokens'))}" if c.get("speculative") else ""
        engine = ENGINE_NAMES.get(c.get("engine") or "own", c.get("engine"))
        lines.append(f"| {name} | {engine} | {decoding} | {_setting(c.get('tree_nodes'))} | {_setting(c.get('lookup'))} | "
                     f"{c.get('questions', '-')} | {_num(c.get('tokens_per_s'), '.1f')} | "
                     f"{_num(c.get('tau'))} | {_num(c.get('predicted_tau'))} | {_num(c.get('speedup_vs_plain'))}x "
                     f"({_num(ci[0])}-{_num(ci[1])}) | {_num(c.get('predicted_speedup_vs_plain'))} | "
                     f"{'-' if same is None else f'{same:.0%}'} |")
    if v:
        lines += ["", *verdict_sentences(v, strong=_bold)]
    medusa = [c for c in report["configs"] if c.get("predicted_accepted_per_position")]
    if v.get("fastest_engine") and medusa:
        worst = max(abs(e) for c in medusa for e in c.get("accepted_per_position_error") or [0])
        lines.append(f"vLLM + Medusa: accepted drafts per chain position, as vLLM counted them, within {worst:.3f} "
                     f"of the suite's prediction at every position of chains 1-{max(len(c['predicted_accepted_per_position']) for c in medusa)}.")
        if line := medusa_bound_line(medusa):
            lines.append(line)
    if v.get("predictions"):
        lines.append(f"Predictions priced with "
                     f"{q.get('predictions_priced_with', 'the latency profile measured before the replay')}.")
    for c in report.get("distribution_checks") or []:
        if c.get("p_value") is not None:
            lines.append(f"{c['config']} against {c['reference']} ({c['questions']} questions, {c['answers']} answers): "
                         f"log-likelihood per token differs by {c['mean_difference']:+.3f} nats, p = {c['p_value']:.2f} "
                         f"({'indistinguishable' if c['indistinguishable'] else 'different'}; the test detects "
                         f"{c['detectable_at_80_power']:.2f} nats/token with 80 % power).")
    return "\n".join(lines)


def refresh(results: Path, readme: Path, docs: Path) -> list[Path]:
    report_file = results / "report.json"
    if not report_file.is_file():
        raise FileNotFoundError(f"{report_file} not found: run nox -s bench first")
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    report = json.loads(report_file.read_text())
    readme.write_text(f"{head}{BEGIN}\n{render_compact(report)}\n{END}{tail}")
    results_md = docs / "results.md"
    results_md.write_text("# Results of the last bench run\n\nWritten by `python -m bench.report.readme` from the run's "
                          "`report.json` and plots, never by hand.\n\n" + render(report) + "\n\n"
                          + "".join(f"![{alt}]({name})\n\n" for name, alt in FIGURE_TEXT.items()))
    written = [readme, results_md]
    for name in FIGURES:
        src = results / "plots" / name
        if src.is_file():
            shutil.copyfile(src, docs / name)
            written.append(docs / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report.readme", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results/bench")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--docs", default="docs")
    args = parser.parse_args(argv)
    try:
        for path in refresh(Path(args.results), Path(args.readme), Path(args.docs)):
            print(f"written: {path}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.report.readme: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
