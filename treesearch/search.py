"""Optuna study over candidate trees: node budget, depth, per-depth rank caps; objective tau or speed-up.

Each trial's tree is the most probable set of paths allowed by its parameters (exact for the
position-averaged greedy objective within those limits), so the search explores what that rule
alone ignores: the hardware cost of each node (through the latency profile), how deep and how wide
a tree should be, and how many heads to use. With joint statistics (rollouts) a trial's tree is scored
by the step walk over them, the tau the decoder realises, which lies below the position average the
trees are built for wherever acceptance comes in runs. The exact unconstrained optimum is enqueued as a
warm start and the official ``mc_sim_7b_63`` tree as a baseline trial.

With rollout tokens in the statistics (``texts``) and a latency profile, a greedy search is a search over
*configurations*, everything the runtime can run: no heads or a heads tree, a prompt-lookup chain of
0..8 draft tokens, a confidence gate; each trial is replayed on the rollouts (heads, lookup and gate
jointly, ``treesearch.replay``) and priced step by step at its real context. Plain decoding, plain +
lookup and small trees are enqueued beside the optimum, so "use no heads" is an answer the search can
give, and does, where the heads do not pay on the workload and machine at hand.

Storage is any Optuna storage URL (SQLite in ``results/`` by default; PostgreSQL, ``postgresql://...`` with
the ``postgres`` extra, or MySQL for many machines). Studies are resumable and shared between workers: the
worker whose ``create_study`` wins seeds the study, the others load it (``open_study``); running trials beat
a heartbeat, and a dead worker's trial is failed and re-enqueued by the next; the study stops once it holds
``trials`` complete trials, whoever ran them.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from .cost import LatencyProfile, predict
from .ngram import MAX_LOOKUP
from .optimal import Constraints, JointModel, PathModel, expected_depth, model_for, optimal_tree
from .replay import Decoding, ReplayResult, replay
from .stats import AcceptanceStats, StatsError, tau_step_walk
from .targets import TARGETS, Target, load_engine_costs
from .tree import Tree, load_tree, make_tree, read_json, save_tree
from .typical import TypicalParams, typical_walk

BASELINE_TREE = "mc_sim_7b_63"


@dataclass(frozen=True)
class SearchConfig:
    budget: int  # largest number of non-root nodes a tree may have
    trials: int = 60  # complete trials the study should hold when done
    objective: str = "auto"  # tau | speedup | auto (speedup when a latency profile is given)
    storage: str = "sqlite:///results/treesearch.db"  # any Optuna storage URL
    study_name: str = "medusa-tree"  # shared by workers of one study
    seed: int = 0  # sampler seed
    joint: bool | None = None  # use joint rollout statistics (None: when present)
    min_budget: int = 1  # smallest node budget a trial may pick
    context: int | None = None  # context length for the latency model (None: median)
    baseline: str = BASELINE_TREE  # official tree evaluated as a baseline trial
    accept: str = "greedy"  # greedy | typical (searches the thresholds too; needs typical statistics)
    max_regret: float = 0.05  # typical: quality floor, nats per token, for the tree chosen from the Pareto front
    configurations: bool = True  # greedy with rollout tokens and latency: also search no heads, lookup and gate
    max_lookup: int = MAX_LOOKUP  # longest prompt-lookup chain a configuration may draft
    heartbeat: int = 5  # seconds between a running trial's heartbeats
    grace: int = 20  # seconds without one after which another worker fails the trial and re-enqueues it
    target: str = "own"  # where the configuration is deployed (treesearch.targets): the space is what it runs
    engine_costs: str | None = None  # a report.json of the engines session: price the target's chains with its costs

    def __post_init__(self) -> None:
        if self.accept not in ("greedy", "typical"):
            raise StatsError(f"unknown acceptance rule {self.accept!r}; use greedy or typical")
        if self.max_regret < 0:
            raise StatsError(f"max_regret must be >= 0, got {self.max_regret}")
        if self.budget < 1:
            raise StatsError(f"the node budget must be >= 1, got {self.budget}")
        if self.trials < 1:
            raise StatsError(f"trials must be >= 1, got {self.trials}")
        if self.objective not in ("tau", "speedup", "auto"):
            raise StatsError(f"unknown objective {self.objective!r}; use tau or speedup")
        if not 0 <= self.max_lookup <= 32:
            raise StatsError(f"max_lookup must be within 0..32, got {self.max_lookup}")
        if self.target not in TARGETS:
            raise StatsError(f"unknown target {self.target!r}; use one of {', '.join(TARGETS)}")
        if self.target != "own" and self.accept != "greedy":
            raise StatsError(f"--target {self.target}: the engines' Medusa acceptance is greedy (typical acceptance "
                             "is this runtime's)")
        if self.engine_costs is not None and not TARGETS[self.target].chain_only:
            raise StatsError(f"engine step costs price chains: --target {self.target} is not a chain-only engine")
        if self.heartbeat < 1 or self.grace <= self.heartbeat:
            raise StatsError(f"heartbeat must be >= 1 s and the grace period longer, got {self.heartbeat} / {self.grace}")


@dataclass(frozen=True)
class TreeScore:
    tree: Tree | None  # None: a configuration without heads (plain decoding, with a lookup chain if any)
    tau: float  # predicted tokens per step
    speedup: float | None  # predicted over plain decoding (None without a latency profile)
    tokens_per_s: float | None
    typical: TypicalParams | None = None  # thresholds (typical acceptance only)
    regret: float | None = None  # typical: quality proxy, nats per token lost against the base model's choice
    sampling_regret: float | None = None  # typical: the sampled tokens' expected regret, per token (see typical.py)
    lookup: int = 0  # prompt-lookup draft tokens beside the tree (0: none)
    gate: float = 0.0  # confidence gate on the tree's levels (0: off)

    @property
    def uses_heads(self) -> bool:
        return self.tree is not None

    @property
    def num_nodes(self) -> int:
        """Nodes of the heads' tree, the root included (1 without heads)."""
        return self.tree.num_nodes if self.tree is not None else 1

    @property
    def decoding(self) -> Decoding:
        return Decoding(self.tree, self.lookup, self.gate)

    @property
    def label(self) -> str:
        return self.decoding.label


@dataclass
class SearchResult:
    best: TreeScore
    optimum: TreeScore  # exact greedy optimum at the full budget (the warm start)
    baseline: TreeScore | None  # the official tree under the same statistics
    study_name: str
    storage: str
    objective: str
    trials_complete: int
    history: list[dict[str, Any]] = field(default_factory=list)  # per trial: number, value, nodes, depth
    pareto: list[TreeScore] = field(default_factory=list)  # typical: speed (or tau) vs regret front
    best_with_heads: TreeScore | None = None  # configurations: the fastest trial that uses heads (= best if it does)
    space: str = "trees"  # trees | configurations (no heads, lookup chain and gate searched too)

    @property
    def tree_score(self) -> TreeScore:
        """The configuration whose tree tree.json carries: the best if it uses heads, else the fastest with heads,
        else the exact optimum."""
        if self.best.tree is not None:
            return self.best
        return self.best_with_heads if self.best_with_heads is not None else self.optimum


def objective_value(score: TreeScore, objective: str) -> float:
    """The number a study maximises for a score: predicted speed-up or tau."""
    return score.speedup if objective == "speedup" else score.tau


def _typical_stats(stats: AcceptanceStats):
    if stats.typical is None:
        raise StatsError("typical acceptance needs typical statistics: calibrate with --typical-temperature")
    return stats.typical


def _with_speed(tree: Tree, tau: float, latency: LatencyProfile | None, context: int | None, **extra) -> TreeScore:
    if latency is None:
        return TreeScore(tree, tau, None, None, **extra)
    pred = predict(latency, tau, tree.num_nodes, context, sampled=extra.get("typical") is not None)
    return TreeScore(tree, tau, pred.speedup, pred.tokens_per_s, **extra)


def score_tree(tree: Tree, model: PathModel, latency: LatencyProfile | None, context: int | None,
               rollouts: Sequence[Sequence[Sequence[int]]] | None = None) -> TreeScore:
    """tau of a greedy tree: with rollouts, their step walk (what the decoder realises: each step starts
    where the last one ended, so a run of easy positions counts once per step, and the walk's tau is
    below the position average wherever acceptance comes in runs); else 1 + the model's expected depth."""
    tau = tau_step_walk(tree, rollouts).tau if rollouts else 1.0 + expected_depth(tree, model)
    return _with_speed(tree, tau, latency, context)


def score_decoding(dec: Decoding, stats: AcceptanceStats, latency: LatencyProfile,
                   plain: ReplayResult | None = None) -> TreeScore:
    """A configuration replayed on the rollouts (heads, lookup chain and gate jointly) and priced step by
    step: speed-up = predicted time of plain decoding / predicted time of the configuration, same rollouts."""
    res = replay(dec, stats, latency)
    base = plain if plain is not None else replay(Decoding(), stats, latency)
    return TreeScore(dec.tree, res.tau, base.time_ms / res.time_ms, res.tokens_per_s, lookup=dec.lookup, gate=dec.gate)


def score_typical(tree: Tree, stats: AcceptanceStats, params: TypicalParams, latency: LatencyProfile | None,
                  context: int | None) -> TreeScore:
    """Tau and regret by replaying typical acceptance on the fitting rollouts (``treesearch.typical``)."""
    walk = typical_walk(tree, _typical_stats(stats).rollouts, params)
    return _with_speed(tree, walk.tau, latency, context, typical=params, regret=walk.regret,
                       sampling_regret=walk.sampling_regret)


class TreeObjective:
    """Optuna objective holding the preloaded statistics and latency profile."""

    def __init__(self, stats: AcceptanceStats, cfg: SearchConfig, latency: LatencyProfile | None):
        self.stats, self.cfg, self.latency = stats, cfg, latency
        self.target: Target = TARGETS[cfg.target]
        self.budget = min(cfg.budget, self.target.max_nodes or cfg.budget)  # the target's own draft limit
        self.max_lookup = cfg.max_lookup if self.target.lookup else 0
        self.model = model_for(stats, cfg.joint)
        self.objective = cfg.objective if cfg.objective != "auto" else ("speedup" if latency else "tau")
        if self.objective == "speedup" and latency is None:
            raise StatsError("objective 'speedup' needs a latency profile (--latency)")
        if cfg.accept == "typical":
            _typical_stats(stats)  # fail before the study starts
        # configurations (no heads, lookup, gate) replayed jointly: greedy, with rollout tokens and a profile
        self.configurations = (cfg.configurations and cfg.accept == "greedy" and latency is not None
                               and stats.has_texts and self.objective == "speedup")
        self.plain = replay(Decoding(), stats, latency) if self.configurations else None
        self.engine_costs = load_engine_costs(cfg.engine_costs, self.target) if cfg.engine_costs else None
        if self.engine_costs is not None and not self.chain_depths:
            raise StatsError(f"{cfg.engine_costs}: no measured chain length is within the {stats.num_heads} heads")
        if self.engine_costs is not None and not self.configurations:
            raise StatsError("engine step costs price replayed configurations: give rollouts with tokens, --latency "
                             "and the speedup objective")

    @property
    def directions(self) -> list[str]:
        """Speed (or tau) up; for typical acceptance also the quality proxy (minus regret) up."""
        return ["maximize", "maximize"] if self.cfg.accept == "typical" else ["maximize"]

    def value(self, score: TreeScore) -> float:
        return objective_value(score, self.objective)

    def values(self, score: TreeScore) -> float | tuple[float, float]:
        if self.cfg.accept == "typical":
            return self.value(score), -score.regret
        return self.value(score)

    def score(self, tree: Tree | None, params: TypicalParams | None = None, lookup: int = 0,
              gate: float = 0.0) -> TreeScore:
        if self.configurations:
            score = score_decoding(Decoding(tree, lookup, gate), self.stats, self.latency, self.plain)
            if self.engine_costs is None:
                return score
            cost = 1.0 if tree is None else self.engine_costs.by_draft_tokens[len(tree.paths)]
            return TreeScore(tree, score.tau, score.tau / cost, None, lookup=lookup, gate=gate)
        if self.cfg.accept == "typical":
            return score_typical(tree, self.stats, params or TypicalParams(), self.latency, self.cfg.context)
        rollouts = self.stats.rollouts if isinstance(self.model, JointModel) else None
        return score_tree(tree, self.model, self.latency, self.cfg.context, rollouts)

    def tree_for(self, params: dict[str, int]) -> Tree:
        depth = params["depth"]
        caps = tuple(params[f"rank_cap_{d}"] for d in range(depth))
        tree, _ = optimal_tree(self.model, params["nodes"], Constraints(max_depth=depth, rank_caps=caps), "search")
        return tree

    def typical_params(self, trial: optuna.Trial) -> TypicalParams | None:
        if self.cfg.accept != "typical":
            return None
        return TypicalParams(trial.suggest_float("posterior_threshold", 0.01, 0.5, log=True),
                             trial.suggest_float("posterior_alpha", 0.03, 1.0, log=True))

    @property
    def chain_depths(self) -> list[int]:
        """The chain lengths a chain-only target may draft: up to the heads (and, priced with the engine's own step
        costs, the lengths it was measured at)."""
        depths = range(1, min(self.stats.num_heads, self.budget) + 1)
        return [d for d in depths if self.engine_costs is None or d in self.engine_costs.by_draft_tokens]

    def chain(self, depth: int) -> Tree:
        """The heads' top-1 chain of ``depth`` tokens, all a chain-only target drafts."""
        return make_tree([[0] * d for d in range(1, depth + 1)], name=f"chain:{depth}")

    def suggest_tree(self, trial: optuna.Trial) -> Tree:
        baseline = trial.user_attrs.get("baseline_tree")
        if baseline:
            return load_tree(baseline)
        k, topk = self.stats.num_heads, self.stats.topk
        if self.target.chain_only:
            depth = trial.suggest_int("depth", 1, min(k, self.budget))
            if depth not in self.chain_depths:
                raise optuna.TrialPruned(f"no measured step cost for a chain of {depth}")
            return self.chain(depth)
        params = {"nodes": trial.suggest_int("nodes", min(self.cfg.min_budget, self.budget), self.budget,
                                             log=True),
                  "depth": trial.suggest_int("depth", 1, k)}
        for d in range(k):  # suggested for every depth so the space is fixed; used up to 'depth'
            params[f"rank_cap_{d}"] = trial.suggest_int(f"rank_cap_{d}", 1, topk)
        return self.tree_for(params)

    def suggest_configuration(self, trial: optuna.Trial) -> tuple[Tree | None, int, float]:
        """(tree or None, lookup tokens, gate): heads or none, then the tree, the lookup chain and the gate."""
        heads = bool(trial.user_attrs.get("baseline_tree")) or trial.suggest_categorical("heads", [False, True])
        lookup = trial.suggest_int("lookup", 0, self.max_lookup)
        if not heads:
            return None, lookup, 0.0
        tree = self.suggest_tree(trial)
        gate = 0.0
        if self.target.gates and not trial.user_attrs.get("baseline_tree") \
                and trial.suggest_categorical("gated", [False, True]):
            gate = trial.suggest_float("gate", 0.02, 0.9, log=True)
            if any((0,) * d not in set(tree.paths) for d in range(1, tree.depth + 1)):
                raise optuna.TrialPruned("the gate reads the top-1 chain, which this tree does not hold")
        return tree, lookup, gate

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        trial.set_user_attr("worker", worker_id())
        if self.configurations:
            tree, lookup, gate = self.suggest_configuration(trial)
            score = self.score(tree, lookup=lookup, gate=gate)
        else:
            typical = self.typical_params(trial)
            tree = self.suggest_tree(trial)
            score = self.score(tree, typical)
        trial.set_user_attr("num_nodes", score.num_nodes)
        trial.set_user_attr("depth", tree.depth if tree is not None else 0)
        trial.set_user_attr("tau", score.tau)
        if score.speedup is not None:
            trial.set_user_attr("speedup", score.speedup)
        if score.regret is not None:
            trial.set_user_attr("regret", score.regret)
        trial.set_user_attr("medusa_choices", tree.as_lists() if tree is not None else None)
        trial.set_user_attr("lookup", score.lookup)
        trial.set_user_attr("gate", score.gate)
        return self.values(score)


POSTGRES_DRIVERS = (("psycopg", "psycopg"), ("psycopg2", "psycopg2"))  # (SQLAlchemy dialect driver, module)


def storage_url(url: str) -> str:
    """``postgresql://...`` as documented, bound to the PostgreSQL driver that is installed (psycopg 3, which the
    ``postgres`` extra brings, else psycopg2): SQLAlchemy's default driver for the bare scheme moved from psycopg2
    to psycopg between releases, and it fails when that one is absent. Other URLs pass as they are."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    rest = url.split("://", 1)[1]
    for driver, module in POSTGRES_DRIVERS:
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}://{rest}"
    raise StatsError("a postgresql:// storage needs a PostgreSQL driver: pip install 'medusa-bench[postgres]'")


def make_storage(url: str, heartbeat: int = 5, grace: int = 20, tries: int = 6) -> optuna.storages.BaseStorage:
    """An RDB storage with heartbeats: a worker that dies mid-trial stops beating, and the next worker to start
    a trial fails it (after ``grace`` seconds) and re-enqueues its parameters (RetryHeartbeatStaleTrialCallback),
    so no trial is lost. SQLite gets a generous lock timeout, so that several local workers can share one file.
    Workers that start together on an empty server database race to create Optuna's tables; the losers see
    them on a retry."""
    import sqlalchemy.exc  # sqlalchemy: only a shared storage's retries need it

    url = storage_url(url)
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)
    for attempt in range(tries):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=heartbeat,
                                                  grace_period=grace, heartbeat_stale_trial_callback=retry)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == tries - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def worker_id() -> str:
    """Who runs a trial (host and process), as a trial's ``worker`` attribute: dashboards and tests read it."""
    return f"{socket.gethostname()}:{os.getpid()}"


@contextmanager
def _setup_lock(url: str) -> Iterator[None]:
    """Serialise schema creation between workers that share one SQLite file (SQLite has no concurrent DDL;
    a server database needs no lock: its workers race on create_study, which one of them wins)."""
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        yield
        return
    db = Path(url.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def open_study(storage: optuna.storages.BaseStorage, name: str, directions: list[str], sampler,
               guards: dict[str, Any], seed: Callable[[optuna.Study], None], wait: float = 120.0) -> optuna.Study:
    """The study ``name``, created and seeded exactly once however many workers open it at the same moment.

    Creating a study is atomic in Optuna's storage (the name is unique), so the one worker whose
    ``create_study`` succeeds writes the guard attributes (what the study's trials were computed from),
    enqueues the seed trials and then marks the study ``seeded``; the others, refused with
    DuplicatedStudyError, load it, wait for that mark and check the guards. A study from before the mark
    (it has trials) counts as seeded."""
    try:
        study = optuna.create_study(study_name=name, storage=storage, directions=directions, sampler=sampler)
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    else:
        for k, v in guards.items():
            study.set_user_attr(k, v)
        seed(study)
        study.set_user_attr("seeded", len(study.trials))
        return study
    deadline = time.monotonic() + wait
    while "seeded" not in study.user_attrs and not study.get_trials(deepcopy=False, states=_FINISHED):
        if time.monotonic() > deadline:
            raise StatsError(f"study {name!r} was created but never seeded (its first worker died while seeding?); "
                             "delete it or use another --study-name")
        time.sleep(0.2)
    return study


_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def _warm_start_params(k: int, topk: int, budget: int, accept: str) -> dict[str, float]:
    params: dict[str, float] = {"nodes": budget, "depth": k, **{f"rank_cap_{d}": topk for d in range(k)}}
    if accept == "typical":  # the Medusa paper's defaults
        defaults = TypicalParams()
        params.update(posterior_threshold=defaults.posterior_threshold, posterior_alpha=defaults.posterior_alpha)
    return params


def _configuration_seeds(warm: dict[str, float], objective: TreeObjective) -> list[dict[str, Any]]:
    """Trials every configuration search starts from: plain decoding, plain + lookup chains, the one-node
    tree, a small and the full-budget optimum, each without and with a lookup chain (a chain-only target:
    every chain)."""
    budget, max_lookup = objective.budget, objective.max_lookup
    lookups = sorted({0, min(4, max_lookup), max_lookup})
    seeds: list[dict[str, Any]] = [{"heads": False, "lookup": n} for n in lookups]
    if objective.target.chain_only:
        return seeds + [{"heads": True, "depth": d, "lookup": 0} for d in objective.chain_depths]
    gated = {"gated": False} if objective.target.gates else {}
    for nodes in sorted({1, min(4, budget), budget}):
        for n in lookups[:2]:
            seeds.append({**warm, "heads": True, "nodes": nodes, "lookup": n, **gated})
    return seeds


def run_search(stats: AcceptanceStats, cfg: SearchConfig, latency: LatencyProfile | None = None,
               show_progress: bool = True) -> SearchResult:
    objective = TreeObjective(stats, cfg, latency)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=cfg.seed)
    with _setup_lock(cfg.storage):
        storage = make_storage(cfg.storage, cfg.heartbeat, cfg.grace)
        study = open_study(storage, cfg.study_name, objective.directions, sampler, _guards(cfg, objective, stats),
                           lambda st: _seed(st, cfg, objective, stats))
    _check_study_matches(study, cfg, objective, stats)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    stop = optuna.study.MaxTrialsCallback(cfg.trials, states=(optuna.trial.TrialState.COMPLETE,))
    remaining = max(0, cfg.trials - _complete(study))
    if remaining:
        study.optimize(objective, n_trials=remaining, callbacks=[stop], show_progress_bar=show_progress,
                       gc_after_trial=False)
    # trials still waiting once the target is reached (a seed, or the retry of a dead worker's trial): run them,
    # so that nothing enqueued is lost
    while _waiting(study):
        study.optimize(objective, n_trials=1, gc_after_trial=False)
    return _result(study, objective, cfg)


def _seed(study: optuna.Study, cfg: SearchConfig, objective: TreeObjective, stats: AcceptanceStats) -> None:
    """The first worker's seed trials (each marked ``seed``: its index): the exact optimum (and, searching
    configurations, plain decoding, lookup chains and small trees), then the official baseline."""
    with warnings.catch_warnings():  # optuna-dashboard shows these names
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["speedup" if objective.objective == "speedup" else "tau"]
                               + (["minus_regret"] if cfg.accept == "typical" else []))
    warm = _warm_start_params(stats.num_heads, stats.topk, objective.budget, cfg.accept)
    if objective.target.chain_only:
        warm = {"depth": min(stats.num_heads, objective.budget)}
    seeds = [(p, {}) for p in (_configuration_seeds(warm, objective) if objective.configurations else [warm])]
    if cfg.baseline and _baseline_runs(cfg.baseline, objective):
        typical = {k: v for k, v in warm.items() if k.startswith("posterior_")}
        seeds.append(({**typical, **({"lookup": 0} if objective.configurations else {})},
                      {"baseline_tree": cfg.baseline}))
    for i, (params, attrs) in enumerate(seeds):
        study.enqueue_trial(params, user_attrs={**attrs, "seed": i})


def _baseline_runs(name: str, objective: TreeObjective) -> bool:
    """Whether the official baseline tree can be scored (its depth and ranks within the statistics') and is one
    the target runs: this runtime's reference trial whatever the node budget; for an engine, only within its
    draft limit (never for a chain-only one)."""
    target, tree = objective.target, load_tree(name)
    if objective.configurations and (tree.depth > objective.stats.num_heads or tree.max_rank >= objective.stats.topk):
        return False  # the replay scores only what the rollouts' ranks hold
    return target.name == "own" or (not target.chain_only
                                    and (target.max_nodes is None or len(tree.paths) <= target.max_nodes))


def _waiting(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def _complete(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _guards(cfg: SearchConfig, objective: TreeObjective, stats: AcceptanceStats) -> dict[str, Any]:
    """What a study's trials were computed from; workers with other inputs are refused."""
    return {"objective": objective.objective, "acceptance_sha256": stats.sha256, "budget": cfg.budget,
            "accept": cfg.accept, "space": "configurations" if objective.configurations else "trees",
            "target": cfg.target, "engine_costs": objective.engine_costs.by_draft_tokens
            if objective.engine_costs else None}


def _check_study_matches(study: optuna.Study, cfg: SearchConfig, objective: TreeObjective,
                         stats: AcceptanceStats) -> None:
    """Refuse to mix runs of different objectives, statistics or search spaces in one study."""
    have = study.user_attrs
    for k, v in _guards(cfg, objective, stats).items():
        # studies from before 'accept' were greedy, and searched trees only
        if _json_like(have.get(k, {"accept": "greedy", "space": "trees", "target": "own"}.get(k))) != _json_like(v):
            raise StatsError(f"study {cfg.study_name!r} was run with {k}={have.get(k)!r}, not {v!r}; "
                             "use another --study-name")


def _json_like(v: Any) -> Any:
    """A guard as the storage gives it back (JSON: dict keys become strings)."""
    return json.loads(json.dumps(v))


def _trial_typical(trial: optuna.trial.FrozenTrial) -> TypicalParams | None:
    if "posterior_threshold" not in trial.params:
        return None
    return TypicalParams(trial.params["posterior_threshold"], trial.params["posterior_alpha"])


def _trial_tree(trial: optuna.trial.FrozenTrial, name: str) -> Tree | None:
    choices = trial.user_attrs["medusa_choices"]
    return make_tree(choices, name=name) if choices else None


def _pick_best(complete: list[optuna.trial.FrozenTrial], cfg: SearchConfig) -> optuna.trial.FrozenTrial:
    """Greedy: the highest value (fewest nodes on ties). Typical: the fastest trial within the quality
    floor (regret <= max_regret); when none is, the one with the least regret."""
    if cfg.accept != "typical":
        return max(complete, key=lambda t: (t.value, -t.user_attrs.get("num_nodes", 0)))
    within = [t for t in complete if -t.values[1] <= cfg.max_regret + 1e-12]
    if within:
        return max(within, key=lambda t: (t.values[0], t.values[1], -t.user_attrs.get("num_nodes", 0)))
    return max(complete, key=lambda t: (t.values[1], t.values[0]))


def _history_row(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    row = {"number": t.number, "value": t.values[0], "num_nodes": t.user_attrs.get("num_nodes"),
           "depth": t.user_attrs.get("depth"), "tau": t.user_attrs.get("tau"), "speedup": t.user_attrs.get("speedup"),
           "baseline": t.user_attrs.get("baseline_tree"), "lookup": t.user_attrs.get("lookup", 0),
           "gate": t.user_attrs.get("gate", 0.0)}
    if "regret" in t.user_attrs:
        row.update(regret=t.user_attrs["regret"], **t.params)
    return row


def _result(study: optuna.Study, objective: TreeObjective, cfg: SearchConfig) -> SearchResult:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        raise StatsError(f"study {cfg.study_name!r} has no complete trial")
    best_trial = _pick_best(complete, cfg)
    default = TypicalParams() if cfg.accept == "typical" else None  # optimum and baseline: the paper's thresholds
    if objective.target.chain_only:  # the best chain, each scored (there are at most K)
        opt_tree = max((objective.chain(d) for d in objective.chain_depths),
                       key=lambda t: objective.value(objective.score(t)))
    else:
        opt_tree, _ = optimal_tree(objective.model, objective.budget, name=f"optimal-{objective.budget}")
    baseline = objective.score(load_tree(cfg.baseline), default) \
        if cfg.baseline and _baseline_runs(cfg.baseline, objective) else None
    pareto = []
    if cfg.accept == "typical":
        front = sorted(study.best_trials, key=lambda t: t.values[0])
        pareto = [objective.score(_trial_tree(t, f"pareto-{t.number}"), _trial_typical(t)) for t in front]
    history = [_history_row(t) for t in sorted(complete, key=lambda t: t.number)]
    best = _trial_score(objective, best_trial, f"{cfg.study_name}-best")
    with_heads = best
    if objective.configurations and best.tree is None:
        headed = [t for t in complete if t.user_attrs.get("medusa_choices")]
        with_heads = _trial_score(objective, _pick_best(headed, cfg), f"{cfg.study_name}-heads") if headed else None
    return SearchResult(best, objective.score(opt_tree, default), baseline, cfg.study_name, cfg.storage,
                        objective.objective, len(complete), history, pareto, with_heads,
                        "configurations" if objective.configurations else "trees")


def _trial_score(objective: TreeObjective, trial: optuna.trial.FrozenTrial, name: str) -> TreeScore:
    """A complete trial scored again from what it recorded: tree, thresholds, lookup chain, gate."""
    return objective.score(_trial_tree(trial, name), _trial_typical(trial), int(trial.user_attrs.get("lookup", 0)),
                           float(trial.user_attrs.get("gate", 0.0)))


# ---------------------------------------------------------------------------- the file a search writes


def _decoding_json(score: TreeScore) -> dict[str, Any]:
    return {"config": score.label, "uses_heads": score.uses_heads, "lookup": score.lookup, "gate": score.gate,
            "medusa_choices": score.tree.as_lists() if score.tree is not None else None,
            "tree_nodes": score.num_nodes - 1 if score.tree is not None else None,
            "predicted_tau": round(score.tau, 6),
            "predicted_speedup": round(score.speedup, 6) if score.speedup is not None else None}


def write_search(result: SearchResult, stats: AcceptanceStats, cfg: SearchConfig, out: str | Path,
                 acceptance_file: str | None = None, latency_file: str | None = None,
                 schedule: list[dict[str, Any]] | None = None) -> Path:
    """tree.json: the best tree with heads (what engines load) with its provenance and, for a configuration
    search, ``recommended``: the fastest configuration overall, which may use no heads at all; with
    ``schedule`` (``treesearch.schedule``), the configuration for each range of batch sizes too."""
    best, headed, tree_score = result.best, result.best_with_heads, result.tree_score
    joint = cfg.joint if cfg.joint is not None else stats.has_joint
    provenance: dict[str, Any] = {
        "model": stats.meta.get("model"), "heads": stats.meta.get("heads"),
        "acceptance_file": acceptance_file, "acceptance_sha256": stats.sha256, "latency_file": latency_file,
        "node_budget": min(cfg.budget, TARGETS[cfg.target].max_nodes or cfg.budget), "predicted_tau": round(tree_score.tau, 6),
        "predicted_speedup": round(tree_score.speedup, 6) if tree_score.speedup is not None else None,
        "estimator": "joint replay" if joint else "independence",
        "search": {"tool": "optuna", "study": cfg.study_name, "storage": cfg.storage, "objective": result.objective,
                   "space": result.space,
                   "trials_complete": result.trials_complete, "seed": cfg.seed},
    }
    target = TARGETS[cfg.target]
    provenance["target"] = target.name
    provenance["cost_model"] = cost_model(target, latency_file, cfg.engine_costs)
    if "selected" in stats.meta:  # a fold of a cross-fitted workload: which rollouts it was fitted on
        provenance["fitted_on"] = stats.meta["selected"]
    if tree_score.lookup or tree_score.gate:
        provenance["decoding"] = {"lookup": tree_score.lookup, "gate": tree_score.gate}
    if best.typical is not None:
        provenance["acceptance"] = {"rule": "typical", "temperature": stats.typical.temperature,
                                    "posterior_threshold": best.typical.posterior_threshold,
                                    "posterior_alpha": best.typical.posterior_alpha,
                                    "predicted_regret": round(best.regret, 6), "max_regret": cfg.max_regret,
                                    "pareto": [{"medusa_choices": s.tree.as_lists(), "tau": round(s.tau, 6),
                                                "speedup": s.speedup, "regret": round(s.regret, 6),
                                                "total_regret": round(s.regret + (s.sampling_regret or 0.0), 6),
                                                "posterior_threshold": s.typical.posterior_threshold,
                                                "posterior_alpha": s.typical.posterior_alpha}
                                               for s in result.pareto]}
    if schedule is not None:
        provenance["schedule"] = schedule
    if headed is not None or best.tree is None:
        provenance["recommended"] = _decoding_json(best)
        if best.tree is None:
            provenance["recommended"]["note"] = (
                "no heads: on this workload and machine the fastest configuration uses none; medusa_choices is the "
                "fastest configuration with heads" + (f" ({headed.label}, predicted {headed.speedup:.3f}x)"
                                                      if headed is not None and headed.speedup else ""))
    return save_tree(tree_score.tree, out, **provenance)


def cost_model(target: Target, latency_file: str | None, engine_costs: str | None = None) -> str:
    """What the predicted speed-ups were priced with, in words (tree.json's ``cost_model``)."""
    if engine_costs is not None:
        return load_engine_costs(engine_costs, target).describe() + "; speed-up over the engine's plain decoding"
    if latency_file is None:
        return "none: tau only, no latency profile"
    if target.name == "own":
        return f"this runtime's measured step costs ({latency_file})"
    return (f"this runtime's measured step costs ({latency_file}), not {target.engine}'s: the speed-up is what this "
            f"runtime gains from the configuration {target.engine} runs; {target.engine}'s own step costs are "
            "measured by the engines session (nox -s engines)")


def load_recommendation(path: str | Path, with_heads: bool = False) -> Decoding:
    """The configuration a search file recommends (``recommended``), or with ``with_heads`` its fastest
    configuration with heads: the file's tree with its lookup chain and gate (``decoding``)."""
    obj = read_json(path, StatsError, "search file")
    if not isinstance(obj, dict):
        raise StatsError(f"search file {path} is not a JSON object")
    rec = obj.get("recommended")
    if rec is None or with_heads:
        decoding = obj.get("decoding") or {}
        return Decoding(load_tree(str(path)), int(decoding.get("lookup", 0)), float(decoding.get("gate", 0.0)))
    tree = make_tree(rec["medusa_choices"], name=Path(path).stem) if rec.get("medusa_choices") else None
    return Decoding(tree, int(rec.get("lookup", 0)), float(rec.get("gate", 0.0)))
