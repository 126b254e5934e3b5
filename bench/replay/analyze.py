"""Analysis of replay records with pandas: tokens/s, speed-ups, tau, head acceptance, greedy equality.

Speed-up over a baseline is the ratio of total tokens over total time (Spec-Bench's definition),
per category and overall; tau is total tokens over total steps for the runtime's methods.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd


def records_frame(records: Sequence[dict]) -> pd.DataFrame:
    if not records:
        raise ValueError("no records to analyse")
    df = pd.DataFrame.from_records(records)
    return df


def summary(df: pd.DataFrame, baselines: Sequence[str]) -> pd.DataFrame:
    """One row per (configuration, category) plus an 'overall' category."""
    both = pd.concat([df, df.assign(category="overall")], ignore_index=True)
    g = both.groupby(["config", "category"], sort=False)
    out = g.agg(tokens=("new_tokens", "sum"), seconds=("wall_time", "sum"), steps=("steps", "sum"),
                runs=("new_tokens", "size")).reset_index()
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    out["tau"] = out["tokens"] / out["steps"].where(out["steps"] > 0)
    for base in baselines:
        ref = out[out["config"] == base].set_index("category")["tokens_per_s"]
        out[f"speedup_vs_{base}"] = out["tokens_per_s"] / out["category"].map(ref)
    return out


def greedy_equality(df: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Share of (question, turn) outputs identical to the reference configuration's, per configuration
    (greedy runs only: sampled answers are not expected to match). A configuration that decoded with another
    base (heads with an adapter of their own: the record's ``model``) is compared with plain decoding of that
    base, where the replay ran it (no lookup), else not at all; ``reference`` names what each row is compared
    with."""
    if "temperature" in df.columns:
        df = df[df["temperature"].fillna(0.0) == 0.0]
    first = df[df["repeat"] == 0]
    models = first.groupby("config", sort=False)["model"].first() if "model" in first else None

    def outputs(name: str) -> pd.Series:
        return first[first["config"] == name].set_index(["question_id", "turn"])["token_ids"]

    def reference_for(name: str) -> str | None:
        if models is None or reference not in models or models[name] == models[reference]:
            return reference
        plain = first[(first["method"] == "plain") & (first["model"] == models[name])]
        if "lookup_tokens" in plain:
            plain = plain[plain["lookup_tokens"].fillna(0) == 0]
        return plain["config"].iloc[0] if len(plain) else None

    rows = []
    for name, sub in first.groupby("config", sort=False):
        ref_name = reference_for(name)
        ref = outputs(ref_name) if ref_name is not None else pd.Series(dtype=object)
        keyed = sub.set_index(["question_id", "turn"])["token_ids"]
        common = keyed.index.intersection(ref.index)
        same = sum(list(keyed[k]) == list(ref[k]) for k in common)
        agree = [token_agreement(list(keyed[k]), list(ref[k])) for k in common]
        rows.append({"config": name, "reference": ref_name, "compared": len(common), "identical": same,
                     "identical_share": same / len(common) if len(common) else float("nan"),
                     "token_agreement": sum(agree) / len(agree) if agree else float("nan")})
    return pd.DataFrame(rows)


def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """The share of positions at which two answers hold the same token, over the longer one (1.0: identical;
    an answer that diverges early and stays apart scores its common prefix and chance matches after it)."""
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / longest


COUNT_NAMES = {"nodes", "questions", "tokens", "steps", "compared", "identical", "lookup", "answers", "rounds", "runs"}


def to_markdown(table: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """A Markdown table: missing values as '-', counts as integers (a count column that pandas made float because
    some rows lack a value), other floats as ``floatfmt``."""
    cols = list(table.columns)

    def whole(col) -> bool:
        vals = [v for v in table[col] if isinstance(v, float) and not math.isnan(v)]
        named = str(col).split("_")[-1] in COUNT_NAMES
        return named and bool(vals) and all(v.is_integer() for v in vals)

    counts = {c for c in cols if whole(c)}

    def cell(col, v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return str(int(v)) if col in counts else format(v, floatfmt)
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(cell(c, v) for c, v in zip(cols, row)) + " |")
    return "\n".join(lines)


def write_tables(df: pd.DataFrame, baselines: Sequence[str], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = summary(df, baselines)
    eq = greedy_equality(df, baselines[0])
    paths = {"summary_csv": out / "summary.csv", "summary_md": out / "summary.md", "equality_csv": out / "equality.csv"}
    s.to_csv(paths["summary_csv"], index=False)
    overall = s[s["category"] == "overall"].drop(columns=["category"])
    paths["summary_md"].write_text(to_markdown(overall) + "\n\n" + to_markdown(eq) + "\n")
    eq.to_csv(paths["equality_csv"], index=False)
    return paths
