"""``nox -s bench``: every stage end to end on the default model, each stage cached by its inputs.

    heads (shipped, or trained with --retrain) -> calibrate -> profile -> search -> replay -> report

A stage is skipped when its output exists and the hash of its inputs (configuration plus the
files it reads) matches the one recorded in ``results/bench/stages.json``; a second run only
redoes what changed. ``--profile quick`` (default) is sized for a 2-core CPU; ``--profile full``
replays all of MT-Bench.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from treesearch.tree import write_json_atomic

# bump when the runtime's speed changes, so that cached latency profiles and replays are measured again
# (stage keys hash the stages' inputs, not the code). 2: the lean engine. 3: heads' draft vocabulary,
# prepacked head projection. 4: latency profile timed in rounds across tree sizes, plain step from the same rounds.
# 5: the lean engine's C forward for bf16 decode steps.
RUNTIME_REVISION = 5
TYPICAL_TEMPERATURE = 0.7  # calibration also stores what a typical-acceptance search at this temperature needs


@dataclass(frozen=True)
class BenchProfile:
    calib_prompts: int  # calibration prompts (builtin calibration split)
    calib_tokens: int  # rollout length
    latency_nodes: tuple[int, ...]  # tree sizes profiled
    latency_contexts: tuple[int, ...]
    latency_repeats: int
    search_budget: int  # largest tree searched (root excluded)
    search_trials: int
    questions: int  # MT-Bench questions replayed (spread over the 8 categories)
    turns: int
    max_new_tokens: int


PROFILES = {
    "quick": BenchProfile(60, 128, (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128), (256,), 5, 64, 40, 16, 1, 96),
    "full": BenchProfile(144, 192, (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256), (128, 512), 7, 128,
                         120, 80, 2, 256),
}


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"


def folder_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


class StageCache:
    def __init__(self, out: Path):
        self.file = out / "stages.json"
        self.keys: dict[str, str] = json.loads(self.file.read_text()) if self.file.is_file() else {}

    @staticmethod
    def key_of(inputs: dict) -> str:
        return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def run(self, name: str, inputs: dict, outputs: list[Path], fn: Callable[[], None]) -> bool:
        key = self.key_of(inputs)
        if self.keys.get(name) == key and all(p.exists() for p in outputs):
            print(f"[bench] {name}: cached ({key})", flush=True)
            return False
        print(f"[bench] {name}: running ...", flush=True)
        t0 = time.perf_counter()
        fn()
        self.keys[name] = key
        write_json_atomic(self.file, self.keys)
        print(f"[bench] {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        return True


def _cli(*argv: str) -> None:
    from bench.cli import main

    code = main(list(argv))
    if code:
        raise SystemExit(f"[bench] stage failed: medusa-bench {' '.join(argv)}")


def run(profile_name: str, retrain: bool, out: Path, dtype: str) -> None:
    from medusa_runtime.heads import shipped_heads_dir
    from medusa_runtime.prompts import BUILTIN_REVISION

    prof = PROFILES[profile_name]
    out.mkdir(parents=True, exist_ok=True)
    cache = StageCache(out)
    t_start = time.perf_counter()

    heads_dir = shipped_heads_dir()
    if retrain or heads_dir is None:
        heads_dir = out / "heads-trained" / "heads"
        from bench.cli import TRAIN_PROFILES

        train_key = {"profile": "quick", **TRAIN_PROFILES["quick"], "prompts_rev": BUILTIN_REVISION}
        cache.run("train", train_key, [heads_dir],
                  lambda: _cli("train", "--profile", "quick", "--out", str(out / "heads-trained")))
    heads = str(heads_dir)
    heads_key = folder_hash(heads_dir)

    acc = out / "acceptance.json"
    cache.run("calibrate", {"heads": heads_key, "p": prof.calib_prompts, "t": prof.calib_tokens, "dtype": dtype,
                            "typical_t": TYPICAL_TEMPERATURE, "prompts_rev": BUILTIN_REVISION},
              [acc], lambda: _cli("calibrate", "--heads", heads, "--dtype", dtype, "--limit", str(prof.calib_prompts),
                                  "--max-new-tokens", str(prof.calib_tokens), "--heldout", "0.25", "--out", str(acc),
                                  "--typical-temperature", str(TYPICAL_TEMPERATURE), "--plots", str(out / "plots")))
    lat = out / "latency.json"
    cache.run("profile", {"heads": heads_key, "nodes": prof.latency_nodes, "ctx": prof.latency_contexts,
                          "dtype": dtype, "runtime": RUNTIME_REVISION}, [lat],
              lambda: _cli("profile", "--heads", heads, "--dtype", dtype, "--nodes", *map(str, prof.latency_nodes),
                           "--contexts", *map(str, prof.latency_contexts), "--repeats", str(prof.latency_repeats),
                           "--out", str(lat), "--plots", str(out / "plots")))
    tree = out / "tree.json"
    db = out / "treesearch.db"
    study = f"bench-{file_hash(acc)}-{file_hash(lat)}"
    cache.run("search", {"acc": file_hash(acc), "lat": file_hash(lat), "budget": prof.search_budget,
                         "trials": prof.search_trials}, [tree],
              lambda: _cli("search", "--acceptance", str(acc), "--latency", str(lat), "--budget",
                           str(prof.search_budget), "--trials", str(prof.search_trials), "--storage",
                           f"sqlite:///{db}", "--study", study, "--out", str(tree), "--plots", str(out / "plots"),
                           "--quiet"))
    # typical acceptance: thresholds and tree searched together against the regret proxy (Pareto plot)
    tree_typical = out / "tree-typical.json"
    cache.run("search-typical", {"acc": file_hash(acc), "lat": file_hash(lat), "budget": prof.search_budget,
                                 "trials": prof.search_trials},
              [tree_typical],
              lambda: _cli("search", "--acceptance", str(acc), "--latency", str(lat), "--budget",
                           str(prof.search_budget), "--trials", str(prof.search_trials), "--accept", "typical",
                           "--storage", f"sqlite:///{db}", "--study", f"{study}-typical", "--out", str(tree_typical),
                           "--plots", str(out / "plots"), "--quiet"))
    # every chain the heads allow, so that "the best chain" is the best measured one, not a prediction
    chains = [{"name": f"medusa chain:{d}", "method": "medusa", "tree": f"chain:{d}"}
              for d in range(1, _num_heads(acc) + 1)]
    config = {"model": "default", "heads": heads, "dtype": dtype, "max_new_tokens": prof.max_new_tokens,
              "turns": prof.turns, "repeats": 1,
              "configurations": [
                  {"name": "generate", "method": "generate"},
                  {"name": "plain", "method": "plain"},
                  {"name": "prompt-lookup", "method": "prompt_lookup", "prompt_lookup_tokens": 10},
                  {"name": "medusa mc_sim_7b_63", "method": "medusa", "tree": "mc_sim_7b_63"},
                  *chains,
                  {"name": "medusa searched", "method": "medusa", "tree": str(tree)},
                  # the runtime's prompt-lookup chain (4 draft tokens), alone and beside the searched tree
                  {"name": "plain +lookup4", "method": "plain", "lookup_tokens": 4},
                  {"name": "medusa searched +lookup4", "method": "medusa", "tree": str(tree), "lookup_tokens": 4},
              ]}
    cfg_file = out / "replay_config.json"
    write_json_atomic(cfg_file, config)
    replay_dir = out / "replay"
    replay_inputs = {"config": config, "tree": file_hash(tree), "heads": heads_key, "q": prof.questions,
                     "runtime": RUNTIME_REVISION}
    cache.run("replay", replay_inputs,
              [replay_dir / "summary.csv"],
              lambda: _cli("replay", "--config", str(cfg_file), "--heads", heads, "--dtype", dtype,
                           "--max-new-tokens", str(prof.max_new_tokens), "--limit", str(prof.questions),
                           "--out", str(replay_dir)))
    from bench.report import report

    written = report(out)
    print(f"\n[bench] finished in {(time.perf_counter() - t_start) / 60:.1f} min; plots and tables:")
    for p in written:
        print(f"  {p}")


def isolate_records(folder: Path, key: str) -> None:
    """Records resume only within one set of replay inputs (``replay`` and ``speed`` call this): records made
    under other inputs (another runtime revision, tree or heads) are moved aside to ``records.<their key>.jsonl``, never mixed in."""
    folder.mkdir(parents=True, exist_ok=True)
    marker, records = folder / "inputs.key", folder / "records.jsonl"
    old = marker.read_text().strip() if marker.is_file() else "unknown"
    if old != key and records.is_file():
        records.rename(folder / f"records.{old}.jsonl")
    marker.write_text(key + "\n")


def _num_heads(acc: Path) -> int:
    from treesearch.stats import load_stats

    return load_stats(acc).num_heads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    parser.add_argument("--retrain", action="store_true", help="train heads (quick profile) instead of the shipped ones")
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    print(f"[bench] profile {args.profile}: {asdict(PROFILES[args.profile])}", flush=True)
    run(args.profile, args.retrain, Path(args.out), args.dtype)


if __name__ == "__main__":
    sys.exit(main())
