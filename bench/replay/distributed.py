"""The replay matrix split among workers on several machines, through an Optuna storage (PostgreSQL, MySQL or
SQLite) used as a work queue: Optuna's own claim, heartbeat and retry, no scheduler of our own.

* A unit is one question: all its configurations, turns and repeats, replayed on one machine (in lockstep,
  as a local replay does), so that every ratio between configurations is timed on one machine.
* The worker whose ``create_study`` wins enqueues one WAITING trial per unit (``user_attrs``: the question)
  and marks the queue with the matrix's key; the others load it and are refused if their matrix differs.
* A worker claims a unit by moving a WAITING trial to RUNNING (``set_trial_state_values``: atomic in the
  storage, so a unit is claimed once), beats its heartbeat while replaying, stores the unit's records in the
  trial (``records`` user attribute) and completes it. A worker that dies stops beating; the next worker to
  look fails its trial and re-enqueues the unit (``RetryHeartbeatStaleTrialCallback``). A worker declared
  dead that was only slow cannot complete its old trial any more (Optuna refuses to update a finished
  trial), so its records are dropped: every (question, configuration, repeat) is recorded exactly once.
* ``merged_records``: the records of the completed units, in question order; each record names its
  ``machine``, and the report is written per machine when there are several.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from treesearch.search import make_storage, open_study

STATE = optuna.trial.TrialState


def machine_dir(out: Path, machine: str) -> Path:
    """``out/machines/<machine>``: where one machine's summaries and report go (the name made file-safe)."""
    return out / "machines" / re.sub(r"[^A-Za-z0-9._-]", "_", machine)


@dataclass(frozen=True)
class QueueConfig:
    storage: str  # an Optuna storage URL shared by the workers
    study_name: str  # the queue (one per replay matrix)
    machine: str  # recorded in every record: timings of different machines are never put in one ratio
    worker: str  # who claims a unit (host:pid)
    heartbeat: int = 5  # seconds between a running unit's heartbeats
    grace: int = 20  # seconds without one after which another worker re-enqueues the unit

    def __post_init__(self) -> None:
        if self.heartbeat < 1 or self.grace <= self.heartbeat:
            raise ValueError(f"heartbeat must be >= 1 s and the grace period longer, got {self.heartbeat} / "
                             f"{self.grace}")
        if not self.machine.strip():
            raise ValueError("--machine must not be empty")


class ReplayQueue:
    """One replay matrix's queue in an Optuna storage (see the module's notes)."""

    def __init__(self, cfg: QueueConfig, question_ids: Sequence[int], matrix_key: str):
        self.cfg = cfg
        self.storage = make_storage(cfg.storage, cfg.heartbeat, cfg.grace)

        def fill(study: optuna.Study) -> None:  # the first worker: one WAITING trial per unit
            for i, qid in enumerate(question_ids):
                study.add_trial(optuna.trial.create_trial(state=STATE.WAITING,
                                                          user_attrs={"question_id": int(qid), "unit": i}))

        self.study = open_study(self.storage, cfg.study_name, ["maximize"], None, {"matrix": matrix_key}, fill)
        if self.study.user_attrs.get("matrix") != matrix_key:
            raise ValueError(f"queue {cfg.study_name!r} holds another replay matrix (other configurations, "
                             "questions or runtime); use another --study-name")
        self.units = int(self.study.user_attrs["seeded"])

    def _trials(self, *states: optuna.trial.TrialState) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def _claim(self) -> optuna.trial.FrozenTrial | None:
        """A WAITING unit moved to RUNNING by this worker (atomic in the storage), or None when none waits."""
        for trial in self._trials(STATE.WAITING):
            try:
                if self.storage.set_trial_state_values(trial._trial_id, state=STATE.RUNNING):
                    self.storage.record_heartbeat(trial._trial_id)
                    self.storage.set_trial_user_attr(trial._trial_id, "worker", self.cfg.worker)
                    return trial
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker finished it meanwhile
        return None

    def work(self, run_unit: Callable[[int], list[dict]], progress: bool = True) -> int:
        """Claim and replay units until none is waiting or running; returns how many this worker completed."""
        done = 0
        bar = tqdm(total=self.units, desc=f"replay units ({self.cfg.machine})", unit="unit", disable=not progress)
        bar.update(len(self._trials(STATE.COMPLETE)))
        while True:
            optuna.storages.fail_stale_trials(self.study)  # a dead worker's unit goes back into the queue
            trial = self._claim()
            if trial is None:
                if not self._trials(STATE.WAITING, STATE.RUNNING):
                    break
                time.sleep(1.0)  # others hold the last units: wait in case one of them dies
                continue
            beat = _Heartbeat(self.storage, trial._trial_id, self.cfg.heartbeat)
            try:
                records = [{**r, "machine": self.cfg.machine} for r in run_unit(int(trial.user_attrs["question_id"]))]
            finally:
                beat.stop()
            try:
                self.storage.set_trial_user_attr(trial._trial_id, "records", records)
                self.storage.set_trial_user_attr(trial._trial_id, "machine", self.cfg.machine)
                self.storage.set_trial_state_values(trial._trial_id, state=STATE.COMPLETE,
                                                    values=[float(len(records))])
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # declared dead meanwhile: the unit's retry records it, not this worker
            done += 1
            bar.update(1)
        bar.close()
        return done

    def merged_records(self) -> list[dict]:
        """Every unit's records, in the queue's question order; refused while a unit is not complete."""
        units: dict[int, list[dict]] = {}
        for t in self._trials(STATE.COMPLETE):
            unit = int(t.user_attrs["unit"])
            if unit in units:
                raise RuntimeError(f"queue {self.cfg.study_name!r} completed unit {unit} twice")
            units[unit] = t.user_attrs["records"]
        missing = sorted(set(range(self.units)) - set(units))
        if missing:
            raise RuntimeError(f"queue {self.cfg.study_name!r}: {len(missing)} of {self.units} units not complete")
        return [r for u in sorted(units) for r in units[u]]


class _Heartbeat:
    """Beats a running unit's heartbeat every ``interval`` seconds until stopped (as Optuna's optimize does for
    a trial)."""

    def __init__(self, storage, trial_id: int, interval: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(storage, trial_id, interval), daemon=True)
        self._thread.start()

    def _run(self, storage, trial_id: int, interval: int) -> None:
        while not self._stop.wait(interval):
            storage.record_heartbeat(trial_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
