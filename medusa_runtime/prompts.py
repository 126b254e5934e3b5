"""The project's own offline prompt set for self-distillation and calibration (never MT-Bench).

Four tiers of prompts written for this project, as data (``data/prompts/*.jsonl``: one record a line,
``category`` and ``turns``, read through the same path as a user's prompt file), across the eight kinds of
request MT-Bench covers (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities):
tier 1, short requests crossing templates with topics (about a third with a follow-up turn); tier 2,
longer requests with material to work on and constraints on the answer; tiers 3 (open questions) and 4
(other subjects, frames and record shapes) stand apart, reached by name (``builtin-open``,
``builtin-wide``, ``builtin-all``). The files are fixed, so a prompt's index names the same prompt
everywhere (their hashes are checked in the tests). The composer here only orders them: the default
set is tiers 1-2, and each tier is cut at 80 % for training / calibration, the parts interleaved. Other
sources (ShareGPT-style JSON/JSONL, plain JSONL of prompts) load through :func:`load_prompt_source`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BUILTIN_SOURCE = "medusa-bench/builtin"  # tier 1: short templates x topics
DETAILED_SOURCE = "medusa-bench/builtin-detailed"  # tier 2: longer requests with material and constraints
OPEN_SOURCE = "medusa-bench/builtin-open"  # tier 3: open questions, weighted to the kinds heads do worst
WIDE_SOURCE = "medusa-bench/builtin-wide"  # tier 4: other subjects, frames and record shapes
# --data names of the built-in sets: tiers 1-2 (the default), tier 3 alone, tier 4 alone, all four
BUILTIN_NAMES = ("builtin", "default", "", "builtin-open", "builtin-wide", "builtin-all")
PROMPTS_DIR = Path(__file__).parent / "data" / "prompts"
TIER_FILES = {BUILTIN_SOURCE: "tier1-templates.jsonl", DETAILED_SOURCE: "tier2-detailed.jsonl",
              OPEN_SOURCE: "tier3-open.jsonl", WIDE_SOURCE: "tier4-wide.jsonl"}


@dataclass(frozen=True)
class Prompt:
    turns: tuple[str, ...]  # user turns; the assistant's replies come from the model itself
    category: str
    source: str = BUILTIN_SOURCE
    id: str = ""  # the record's own id (question_id, id or task_id) where it has one


BUILTIN_REVISION = 2  # bump when the built-in prompt set changes (stage caches key on it)
BUILTIN_TRAIN_SHARE = 0.8  # per tier: the first 80 % train heads, the rest calibrate them


def tier_prompts(source: str) -> list[Prompt]:
    """One built-in tier, in its file's order, named by its source."""
    return list(_tier(source))


@cache
def _tier(source: str) -> tuple[Prompt, ...]:  # read once per process
    return tuple(p for r in _read_records(PROMPTS_DIR / TIER_FILES[source]) if (p := _prompt_from_record(r, source)))


def builtin_prompts() -> list[Prompt]:
    """Tiers 1 and 2 (``--data builtin``): the template prompts (first, in their historical order), then
    the detailed requests."""
    return tier_prompts(BUILTIN_SOURCE) + tier_prompts(DETAILED_SOURCE)


def open_prompts() -> list[Prompt]:
    """Tier 3 (``--data builtin-open``): 500 open questions, apart from the default set so that the quick
    profile, the bench's calibration prompts and the release data of tiers 1-2 stay as they were."""
    return tier_prompts(OPEN_SOURCE)


def wide_prompts() -> list[Prompt]:
    """Tier 4 (``--data builtin-wide``): 1,200 requests on other subjects, in other frames, apart from the
    default set like tier 3."""
    return tier_prompts(WIDE_SOURCE)


def _interleave(parts: list[list[Prompt]]) -> list[Prompt]:
    """Merge lists keeping each one's order, spreading each evenly over the result (so any prefix
    holds every tier in proportion)."""
    keyed = [((i + 0.5) / len(part), k, p) for k, part in enumerate(parts) for i, p in enumerate(part)]
    return [p for _, _, p in sorted(keyed, key=lambda x: (x[0], x[1]))]


def builtin_split(prompts: list[Prompt], part: str) -> list[Prompt]:
    """The ``train`` or ``calibration`` part of the built-in prompts: each tier is cut at 80 % (so a
    tier's split never depends on the others) and the parts of the tiers are interleaved."""
    if part not in ("train", "calibration"):
        raise ValueError(f"part must be 'train' or 'calibration', not {part!r}")
    tiers: dict[str, list[Prompt]] = {}
    for p in prompts:
        tiers.setdefault(p.source, []).append(p)
    chosen = []
    for tier in tiers.values():
        cut = int(len(tier) * BUILTIN_TRAIN_SHARE)
        chosen.append(tier[:cut] if part == "train" else tier[cut:])
    return _interleave([c for c in chosen if c])


def _prompt_from_record(rec: dict, source: str) -> Prompt | None:
    """ShareGPT (``conversations``/``messages``), MT-Bench-like (``turns``) or plain (``prompt``/``text``)."""
    if "conversations" in rec or "messages" in rec:
        conv = rec.get("conversations") or rec.get("messages") or []
        turns = tuple(str(m.get("value", m.get("content", ""))) for m in conv
                      if str(m.get("from", m.get("role", ""))).lower() in ("human", "user"))
    elif "turns" in rec:
        turns = tuple(str(t) for t in rec["turns"])
    else:
        text = rec.get("prompt", rec.get("instruction", rec.get("text")))
        turns = (str(text),) if text else ()
    turns = tuple(t for t in turns if t.strip())
    rid = next((rec[k] for k in ("question_id", "id", "task_id") if rec.get(k) is not None), "")
    return Prompt(turns, str(rec.get("category", "other")), source, str(rid)) if turns else None


def _read_records(path: Path) -> list[dict] | dict:
    """A JSON file's value or a JSONL file's records (a user's prompt file, or a built-in tier)."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"prompt file {path} is not valid JSON/JSONL: {exc.msg} (line {exc.lineno})") from None


def _load_with_datasets(source: str, path: Path) -> list[dict]:
    try:
        from datasets import load_dataset  # datasets: optional (the data extra)
    except ImportError:
        raise RuntimeError(f"reading {source} needs the datasets library: pip install 'medusa-bench[data]'") from None
    if path.suffix == ".parquet":
        return list(load_dataset("parquet", data_files=str(path), split="train"))
    return list(load_dataset(source, split="train"))


def load_prompt_source(source: str, limit: int | None = None) -> list[Prompt]:
    """``builtin`` (default), a local JSON/JSONL file, or a parquet file or (online users) a hub dataset id via the
    ``datasets`` library (the ``data`` extra)."""
    if source in BUILTIN_NAMES:
        prompts = {"builtin-open": open_prompts, "builtin-wide": wide_prompts,
                   "builtin-all": lambda: builtin_prompts() + open_prompts() + wide_prompts()
                   }.get(source, builtin_prompts)()
    else:
        path = Path(source)
        if path.is_file() and path.suffix != ".parquet":
            records = _read_records(path)
        elif not path.is_file() and (path.suffix in (".json", ".jsonl", ".parquet") or source.startswith((".", "/"))):
            raise FileNotFoundError(f"prompt file not found: {source}")
        else:  # a parquet file, or (online users) a hub dataset id: the datasets library reads them
            records = _load_with_datasets(source, path)
        if isinstance(records, dict):
            records = [records]
        prompts = [p for r in records if isinstance(r, dict) and (p := _prompt_from_record(r, source))]
        if not prompts:
            raise ValueError(f"no prompts found in {source}")
    return prompts[:limit] if limit else prompts


def mix_parts(spec: str) -> list[str]:
    """The sources of a mix ``A+B+...`` (``builtin-all+results/self-prompts/prompts.jsonl``); a spec that
    names an existing file is that file alone, whatever its name holds."""
    if Path(spec).is_file() or "+" not in spec:
        return [spec]
    parts = [p for p in spec.split("+") if p]
    if not parts:
        raise ValueError(f"empty prompt mix {spec!r}")
    return parts


def mixed_prompts(spec: str, part: str = "train") -> tuple[list[Prompt], dict[str, int]]:
    """A mix's prompts, each source's ``part`` (built-in tiers: their split; other sources whole), spread
    evenly over one another (any prefix holds every source in proportion), and how many each gave."""
    sources = mix_parts(spec)
    loaded = [builtin_split(load_prompt_source(s), part) if s in BUILTIN_NAMES else load_prompt_source(s)
              for s in sources]
    return _interleave([p for p in loaded if p]), {s: len(p) for s, p in zip(sources, loaded)}
