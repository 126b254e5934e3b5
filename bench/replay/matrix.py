"""The replay's matrix of configurations (``replay_config.json``): the runtime's plain decoding and its
peers, Medusa chains and the official tree, each fold's search pick, the sampled configurations, and the
chains of head sets compared beside the main ones. Each configuration is a ``bench.replay.runner.MethodConfig``
as a dict (its JSON form)."""

from __future__ import annotations

import json
from pathlib import Path

from treesearch.search import load_recommendation
from treesearch.stats import load_stats
from treesearch.tree import make_tree, save_tree
from treesearch.typical import SEARCH_TEMPERATURE


def replay_configurations(acc: Path, searches: list[Path], workload: dict, heads: Path | None = None,
                          compare: tuple[str, ...] = (), typical: Path | None = None,
                          heads_only: list[Path] = ()) -> list[dict]:
    """The matrix: the runtime's plain decoding (alone and with a lookup chain), chains of 1, 2 and all heads,
    and per fold the search's pick (plus, where the pick uses no heads, the fold's fastest configuration with
    heads), run on that fold's questions; the official mc_sim_7b_63 tree on every question; on the peers'
    questions also transformers' generate and prompt lookup (slow here, and not predicted). For each head set
    in ``compare`` (e.g. the Medusa-1 heads beside Medusa-2 ones): its chains of 1, 2 and all heads, on the
    base those heads decode with (and plain decoding of that base, where it is another one). ``heads_only``: per
    fold, a search without lookup chains; its fastest configuration with heads is Medusa alone ("searched, heads
    only": a tree, and a gate where one pays), as engines without prompt lookup would serve it."""
    depths = sorted({1, 2, load_stats(acc).num_heads})
    chains = [{"name": f"medusa chain:{d}", "method": "medusa", "tree": f"chain:{d}"} for d in depths]
    configs = [*baseline_configurations(workload["peers"]),
               {"name": "plain +lookup4", "method": "plain", "lookup_tokens": 4},
               {"name": "medusa mc_sim_7b_63", "method": "medusa", "tree": "mc_sim_7b_63"},
               *chains]
    bases: set[str] = set()  # the bases whose plain decoding is in already (two Medusa-1 sets share one)
    for other in compare:
        configs += compare_configurations(other, heads, depths, bases)
    configs += sampled_configurations(typical, workload["peers"])
    for path, fold in zip(searches, workload["folds"]):
        pick = load_recommendation(path)
        configs.append(_config_of("searched", pick, path, fold))
        if not pick.uses_heads:
            configs.append(_config_of("searched, best with heads", load_recommendation(path, with_heads=True), path,
                                      fold))
    for path, fold in zip(heads_only, workload["folds"]):
        configs.append(_config_of("searched, heads only", load_recommendation(path, with_heads=True), path, fold))
    return configs


def baseline_configurations(peers: list[int]) -> list[dict]:
    """What every matrix holds first: the runtime's plain decoding on every question, and on the peers'
    questions transformers' generate and prompt lookup (slow here, and not predicted)."""
    on_peers = {"question_ids": peers}
    return [{"name": "generate", "method": "generate", **on_peers},
            {"name": "plain", "method": "plain"},
            {"name": "prompt-lookup", "method": "prompt_lookup", "prompt_lookup_tokens": 10, **on_peers}]


SAMPLES = 2  # answers drawn per (question, turn) by each sampled configuration, each with its own recorded seed


def sampled_configurations(typical: Path | None, peers: list[int], temperature: float = SEARCH_TEMPERATURE,
                           samples: int = SAMPLES) -> list[dict]:
    """At ``temperature``, on the peers' questions: plain sampling (the reference), exact tree sampling (its
    outputs distributed as plain sampling's) and typical acceptance at three points of the typical search's
    predicted front (least regret, the chosen thresholds, the fastest), on that search's trees."""
    base = {"temperature": temperature, "samples": samples, "question_ids": list(peers)}
    out = [{"name": f"plain T{temperature}", "method": "plain", **base}]
    if typical is None or not typical.is_file():
        return out
    obj = json.loads(typical.read_text())
    acc, front = obj["acceptance"], obj["acceptance"].get("pareto") or []
    out.append({"name": f"medusa sample T{temperature}", "method": "medusa", "accept": "sample", "tree": str(typical),
                **base})
    points = [(f"typical T{temperature}", str(typical), acc["posterior_threshold"], acc["posterior_alpha"])]
    if front:
        for label, p in (("least regret", min(front, key=lambda p: p["regret"])),
                         ("fastest", max(front, key=lambda p: p["speedup"]))):
            f = typical.with_name(f"tree-typical-{label.replace(' ', '-')}.json")
            save_tree(make_tree(p["medusa_choices"], name=f.stem), f, predicted_tau=p["tau"],
                      predicted_speedup=p["speedup"], predicted_regret=p["regret"])
            points.append((f"typical T{temperature} ({label})", str(f), p["posterior_threshold"], p["posterior_alpha"]))
    out += [{"name": name, "method": "medusa", "accept": "typical", "tree": tree,
             "posterior_threshold": eps, "posterior_alpha": delta, **base} for name, tree, eps, delta in points]
    return out


def compare_configurations(compare: str, heads: Path | None, depths: list[int], bases: set[str] | None = None
                           ) -> list[dict]:
    """The other head set's chains (named ``<compare> chain:d``) and, where its base differs from that of the
    main heads (one set carries a Medusa-2 adapter), plain decoding of its base: its lossless reference, once
    per base (``bases``: those already in, updated)."""
    from medusa_runtime.heads.adapter import adapter_info  # torch: spawned search workers import this module
    from medusa_runtime.heads.medusa import heads_folder  # torch: spawned search workers import this module

    folder = heads_folder(compare)
    if folder is None or not (folder / "config.json").is_file():
        raise ValueError(f"--compare-heads {compare}: not a heads folder")
    out = []
    same = heads is not None and folder.resolve() == heads.resolve()
    # a base of its own: the set carries an adapter (the main heads' base then has none or another), or the
    # main heads carry one and this set's base is the original
    info = adapter_info(folder)
    if not same and (info is not None or (heads is not None and adapter_info(heads) is not None)):
        base = "original" if info is None else str(info.path.resolve())
        if bases is None or base not in bases:
            out.append({"name": f"plain, {compare} base", "method": "plain", "heads": compare})
        if bases is not None:
            bases.add(base)
    return out + [{"name": f"{compare} chain:{d}", "method": "medusa", "tree": f"chain:{d}", "heads": compare}
                  for d in depths]


def _config_of(name: str, dec, tree_file: Path, fold: list[int]) -> dict:
    base = {"name": name, "lookup_tokens": dec.lookup, "question_ids": list(fold)}
    if dec.tree is None:
        return {**base, "method": "plain"}
    return {**base, "method": "medusa", "tree": str(tree_file), "gate": dec.gate}
