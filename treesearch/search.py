"""Optuna study over candidate trees: node budget, depth, per-depth rank caps; objective tau or speed-up.

Each trial's tree is the most probable set of paths allowed by its parameters (exact for the
position-averaged greedy objective within those limits), so the search explores what that rule
alone ignores: the hardware cost of each node (through the latency profile), how deep and how wide
a tree should be, and how many heads to use. With joint statistics (rollouts) a trial's tree is scored
by the step walk over them, the tau the decoder realises, which lies below the position average the
trees are built for wherever acceptance comes in runs. The exact unconstrained optimum is enqueued as a
warm start and the official ``mc_sim_7b_63`` tree as a baseline trial.

Storage is any Optuna storage URL (SQLite in ``results/`` by default; PostgreSQL or MySQL for many
machines); ``load_if_exists`` makes studies resumable and shareable between workers, and the study
stops once it holds ``trials`` complete trials, whoever ran them.
"""

from __future__ import annotations

import fcntl
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from .cost import LatencyProfile, predict
from .optimal import Constraints, JointModel, PathModel, expected_depth, model_for, optimal_tree
from .stats import AcceptanceStats, StatsError, tau_step_walk
from .tree import Tree, load_tree, make_tree
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


@dataclass(frozen=True)
class TreeScore:
    tree: Tree
    tau: float  # predicted tokens per step
    speedup: float | None  # predicted over plain decoding (None without a latency profile)
    tokens_per_s: float | None
    typical: TypicalParams | None = None  # thresholds (typical acceptance only)
    regret: float | None = None  # typical: quality proxy, nats per token lost against the base model's choice


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
    pred = predict(latency, tau, tree.num_nodes, context)
    return TreeScore(tree, tau, pred.speedup, pred.tokens_per_s, **extra)


def score_tree(tree: Tree, model: PathModel, latency: LatencyProfile | None, context: int | None,
               rollouts: Sequence[Sequence[Sequence[int]]] | None = None) -> TreeScore:
    """tau of a greedy tree: with rollouts, their step walk (what the decoder realises: each step starts
    where the last one ended, so a run of easy positions counts once per step, and the walk's tau is
    below the position average wherever acceptance comes in runs); else 1 + the model's expected depth."""
    tau = tau_step_walk(tree, rollouts).tau if rollouts else 1.0 + expected_depth(tree, model)
    return _with_speed(tree, tau, latency, context)


def score_typical(tree: Tree, stats: AcceptanceStats, params: TypicalParams, latency: LatencyProfile | None,
                  context: int | None) -> TreeScore:
    """Tau and regret by replaying typical acceptance on the fitting rollouts (``treesearch.typical``)."""
    walk = typical_walk(tree, _typical_stats(stats).rollouts, params)
    return _with_speed(tree, walk.tau, latency, context, typical=params, regret=walk.regret)


class TreeObjective:
    """Optuna objective holding the preloaded statistics and latency profile."""

    def __init__(self, stats: AcceptanceStats, cfg: SearchConfig, latency: LatencyProfile | None):
        self.stats, self.cfg, self.latency = stats, cfg, latency
        self.model = model_for(stats, cfg.joint)
        self.objective = cfg.objective if cfg.objective != "auto" else ("speedup" if latency else "tau")
        if self.objective == "speedup" and latency is None:
            raise StatsError("objective 'speedup' needs a latency profile (--latency)")
        if cfg.accept == "typical":
            _typical_stats(stats)  # fail before the study starts

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

    def score(self, tree: Tree, params: TypicalParams | None) -> TreeScore:
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

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        baseline = trial.user_attrs.get("baseline_tree")
        typical = self.typical_params(trial)
        if baseline:
            tree = load_tree(baseline)
        else:
            k, topk = self.stats.num_heads, self.stats.topk
            params = {"nodes": trial.suggest_int("nodes", min(self.cfg.min_budget, self.cfg.budget), self.cfg.budget,
                                                 log=True),
                      "depth": trial.suggest_int("depth", 1, k)}
            for d in range(k):  # suggested for every depth so the space is fixed; used up to 'depth'
                params[f"rank_cap_{d}"] = trial.suggest_int(f"rank_cap_{d}", 1, topk)
            tree = self.tree_for(params)
        score = self.score(tree, typical)
        trial.set_user_attr("num_nodes", tree.num_nodes)
        trial.set_user_attr("depth", tree.depth)
        trial.set_user_attr("tau", score.tau)
        if score.speedup is not None:
            trial.set_user_attr("speedup", score.speedup)
        if score.regret is not None:
            trial.set_user_attr("regret", score.regret)
        trial.set_user_attr("medusa_choices", tree.as_lists())
        return self.values(score)


def make_storage(url: str) -> optuna.storages.BaseStorage:
    """An RDB storage with heartbeats (so a killed worker's trial is failed, not left running) and,
    for SQLite, a generous lock timeout so that several local workers can share one file."""
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=5, grace_period=20)


@contextmanager
def _setup_lock(url: str) -> Iterator[None]:
    """Serialise schema creation and study seeding between workers that share one SQLite file
    (a server database needs no help: create the study once, then start the workers)."""
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


def _warm_start_params(k: int, topk: int, budget: int, accept: str) -> dict[str, float]:
    params: dict[str, float] = {"nodes": budget, "depth": k, **{f"rank_cap_{d}": topk for d in range(k)}}
    if accept == "typical":  # the Medusa paper's defaults
        defaults = TypicalParams()
        params.update(posterior_threshold=defaults.posterior_threshold, posterior_alpha=defaults.posterior_alpha)
    return params


def run_search(stats: AcceptanceStats, cfg: SearchConfig, latency: LatencyProfile | None = None,
               show_progress: bool = True) -> SearchResult:
    objective = TreeObjective(stats, cfg, latency)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with _setup_lock(cfg.storage):
        storage = make_storage(cfg.storage)
        study = optuna.create_study(study_name=cfg.study_name, storage=storage, directions=objective.directions,
                                    sampler=optuna.samplers.TPESampler(seed=cfg.seed), load_if_exists=True)
        _check_study_matches(study, cfg, objective.objective, stats)
        if not study.trials:  # first worker seeds the study: exact optimum, then the official baseline
            warm = _warm_start_params(stats.num_heads, stats.topk, cfg.budget, cfg.accept)
            study.enqueue_trial(warm)
            if cfg.baseline:
                typical = {k: v for k, v in warm.items() if k.startswith("posterior_")}
                study.enqueue_trial(typical, user_attrs={"baseline_tree": cfg.baseline})
    done = _complete(study)
    remaining = max(0, cfg.trials - done)
    if remaining:
        logging.getLogger("optuna").setLevel(logging.WARNING)
        stop = optuna.study.MaxTrialsCallback(cfg.trials, states=(optuna.trial.TrialState.COMPLETE,))
        study.optimize(objective, n_trials=remaining, callbacks=[stop], show_progress_bar=show_progress,
                       gc_after_trial=False)
    return _result(study, objective, cfg)


def _complete(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _check_study_matches(study: optuna.Study, cfg: SearchConfig, objective: str, stats: AcceptanceStats) -> None:
    """Refuse to mix runs of different objectives or statistics in one study."""
    want = {"objective": objective, "acceptance_sha256": stats.sha256, "budget": cfg.budget,
            "accept": cfg.accept}
    have = study.user_attrs
    if not have:
        for k, v in want.items():
            study.set_user_attr(k, v)
        return
    for k, v in want.items():
        if have.get(k, "greedy" if k == "accept" else None) != v:  # studies from before 'accept' were greedy
            raise StatsError(f"study {cfg.study_name!r} was run with {k}={have.get(k)!r}, not {v!r}; "
                             "use another --study name")


def _trial_typical(trial: optuna.trial.FrozenTrial) -> TypicalParams | None:
    if "posterior_threshold" not in trial.params:
        return None
    return TypicalParams(trial.params["posterior_threshold"], trial.params["posterior_alpha"])


def _trial_tree(trial: optuna.trial.FrozenTrial, name: str) -> Tree:
    return make_tree(trial.user_attrs["medusa_choices"], name=name)


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
           "baseline": t.user_attrs.get("baseline_tree")}
    if "regret" in t.user_attrs:
        row.update(regret=t.user_attrs["regret"], **t.params)
    return row


def _result(study: optuna.Study, objective: TreeObjective, cfg: SearchConfig) -> SearchResult:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        raise StatsError(f"study {cfg.study_name!r} has no complete trial")
    best_trial = _pick_best(complete, cfg)
    best_tree = _trial_tree(best_trial, f"{cfg.study_name}-best")
    opt_tree, _ = optimal_tree(objective.model, cfg.budget, name=f"optimal-{cfg.budget}")
    default = TypicalParams() if cfg.accept == "typical" else None  # optimum and baseline: the paper's thresholds
    baseline = objective.score(load_tree(cfg.baseline), default) if cfg.baseline else None
    pareto = []
    if cfg.accept == "typical":
        front = sorted(study.best_trials, key=lambda t: t.values[0])
        pareto = [objective.score(_trial_tree(t, f"pareto-{t.number}"), _trial_typical(t)) for t in front]
    history = [_history_row(t) for t in sorted(complete, key=lambda t: t.number)]
    return SearchResult(objective.score(best_tree, _trial_typical(best_trial)), objective.score(opt_tree, default),
                        baseline, cfg.study_name, cfg.storage, objective.objective, len(complete), history, pareto)
