"""report.html: one self-contained page, checked in a real headless browser (the system's Chromium through
Playwright): every figure decodes, the page logs no error, nothing is fetched from outside the file."""

from __future__ import annotations

import json
import re

from bench.replay.runner import ReplayConfig, load_records, replay
from bench.report.browser import check_page
from bench.report.build import category_intervals, report
from bench.report.html import FIGURES
from medusa_runtime.heads.medusa import fresh_heads

from .conftest import tiny_chat_model
from .test_replay import CONFIGS, QUESTIONS


def _bench_run(tmp_path):
    """A real replay of three configurations on three questions (tiny chat model), as the bench lays it out."""
    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    out = tmp_path / "run"
    replay(loaded, heads, CONFIGS, QUESTIONS, ReplayConfig(max_new_tokens=8, turns=2, repeats=1, warmup_tokens=2),
           out / "replay" / "records.jsonl", progress=False)
    (out / "command.json").write_text(json.dumps({"command": "python -m bench.pipeline --questions tiny"}))
    return out


def test_report_page_is_self_contained_and_every_figure_loads_in_chromium(tmp_path):
    out = _bench_run(tmp_path)
    written = report(out)
    page = out / "report.html"
    assert page in written
    text = page.read_text()
    # self-contained: no src/href pointing anywhere but into the page itself
    external = [m for m in re.findall(r'(?:src|href)="([^"]*)"', text) if not m.startswith(("data:", "#"))]
    assert external == []
    expected = [f.name for f in FIGURES if (out / "plots" / f"{f.name}.png").is_file()]
    assert {"speedup_by_category_vs_plain", "speedup_by_category_vs_generate", "tau_by_category",
            "speedup_vs_quality"} <= set(expected)
    assert "python -m bench.pipeline --questions tiny" in text and "tiny-chat" in text
    assert "No judge in this run" in text  # proxies labelled as such
    # the paper's figures: a labelled table in both renderings, not lines on this run's chart
    summary_md = (out / "summary.md").read_text()
    assert "the Medusa paper's overall speed-ups" in summary_md and "| Medusa-2 | Vicuna-7B | A100 GPU | 2.830 |" in summary_md
    assert "Vicuna-7B" in text and "A100 GPU" in text

    shot = tmp_path / "report.png"
    check = check_page(page, screenshot=shot)
    assert check.title == "Medusa bench report"
    assert check.errors == ()
    assert check.images == len(expected) and check.loaded == check.images, check.broken
    assert shot.stat().st_size > 50_000  # a full-page PNG of a page with figures, not a blank one


def test_a_broken_figure_and_a_script_error_are_caught(tmp_path):
    """The browser check can fail: a figure that does not decode and a console error are both reported."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><title>t</title></head><body>'
                   '<img alt="broken" src="data:image/png;base64,AAAA"><script>console.error("boom")</script>'
                   '</body></html>')
    check = check_page(bad)
    assert (check.images, check.loaded, check.broken) == (1, 0, ("broken",))
    assert any("boom" in e for e in check.errors) and not check.ok


def test_category_intervals_are_paired_bootstraps_that_hold_the_point(tmp_path):
    """Each category's interval contains that category's speed-up (ratio of totals over its questions)."""
    import pandas as pd

    from bench.replay.analyze import summary

    out = _bench_run(tmp_path)
    df = pd.DataFrame(load_records(out / "replay" / "records.jsonl"))
    table = summary(df, ["plain"]).set_index(["config", "category"])
    ci = category_intervals(df, "plain")
    assert {c for c, _ in ci} == {"generate", "medusa chain:2"}
    for (cfg, cat), (lo, hi) in ci.items():
        assert lo <= table.loc[(cfg, cat), "speedup_vs_plain"] <= hi


def test_configuration_table_shows_counts_and_the_folds_ranges(tmp_path):
    """report.json's lookup and tree_nodes are counts, or lists where the folds' picks differ: the page shows
    integers and ranges (a list once broke the page's table)."""
    from bench.report.html import write_html

    (tmp_path / "report.json").write_text(json.dumps({"configs": [
        {"config": "plain", "lookup": 0, "tree_nodes": None, "tokens_per_s": 100.0},
        {"config": "searched", "lookup": [4, 6], "tree_nodes": [1.0, 3.0], "tokens_per_s": 140.0}]}))
    page = write_html(tmp_path, {}, {"model": "m"}).read_text()
    assert "<td>4-6</td>" in page and "<td>1-3</td>" in page and "<td>0</td>" in page


def test_markdown_tables_show_missing_values_as_dashes_and_counts_as_integers():
    import pandas as pd

    from bench.replay.analyze import to_markdown

    table = pd.DataFrame({"config": ["plain", "medusa"], "tree_nodes": [float("nan"), 4.0], "tau": [1.0, 1.6543],
                          "speedup": [1.0, float("nan")]})
    lines = to_markdown(table).splitlines()
    assert lines[2] == "| plain | - | 1.000 | 1.000 |"
    assert lines[3] == "| medusa | 4 | 1.654 | - |"


def test_the_verdict_is_written_once_for_markdown_and_html():
    """summary.md and report.html say the same sentences: the HTML's, tags removed, are the Markdown's."""
    import html as html_mod

    import pandas as pd

    from bench.report.build import scorecard_section
    from bench.report.html import _verdict

    v = {"fastest": "searched <a&b>", "fastest_tokens_per_s": 165.8, "searched": "searched", "searched_vs_fastest": 1.0,
         "searched_is_fastest": True, "fastest_engine": "vllm plain", "fastest_engine_tokens_per_s": 28.4,
         "fastest_own": "searched", "own_vs_fastest_engine": 5.84, "fastest_heads_only": "medusa chain:2",
         "fastest_heads_only_speedup": 1.35, "predictions": 7, "tau_tolerance": 0.05, "tau_within_tolerance": True,
         "worst_tau_error": 0.006, "speedup_tolerance": 0.1, "speedup_within_tolerance": False,
         "worst_speedup_error": 0.134}
    card = pd.DataFrame([{"config": "plain", "tokens_per_s": 100.0, "fit_positions": None, "speedup_vs_plain_ci": None,
                          "predicted_tau_ci": None}])
    markdown = scorecard_section(card, v)
    page = _verdict({"verdict": v})
    sentences = [html_mod.unescape(re.sub(r"<[^>]+>", "", li)) for li in re.findall(r"<li>(.*?)</li>", page)]
    assert len(sentences) == 5 and all(s in markdown for s in sentences)
    assert "<b>5.84x</b>" in page and "&lt;a&amp;b&gt;" in page and "speed-up within 10 %: no (worst 13.4 %)" in markdown


def test_distinct_colours_never_repeat():
    from bench.report.plots import distinct_colours

    for n in (1, 9, 10, 11, 17, 20, 21, 40):
        colours = [tuple(round(c, 4) for c in rgba) for rgba in distinct_colours(n)]
        assert len(colours) == n and len(set(colours)) == n
