"""The serving loop: requests queue, join the batch when a row is free, and get their tokens step by step.

One thread owns the model::

    loop: drop the rows of cancelled requests
          admit waiting requests while rows are free (each prompt's forward alone)
          run queued calls (work that needs the model but not the batch, e.g. a guided choice)
          one step of every live row (decoding.batch) -> each request's callback gets its new tokens

Other threads (the HTTP server's) only submit, cancel and read counts. The queue is bounded: a request that
finds it full is refused at once (``QueueFull``), not held. A request's callback runs on the loop's thread and
must not block: it hands the tokens over (an asyncio queue's ``call_soon_threadsafe``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.batch import BatchDecoder, StepTokens
from medusa_runtime.decoding.decode import GenerateStats


class QueueFull(RuntimeError):
    """The scheduler's queue holds as many requests as it may: try again later."""


@dataclass(eq=False)
class Job:
    """One request: its prompt, length cap and rule, and where its tokens go (called on the loop's thread with
    each step's tokens, the stop reason ("" while going on) and, at the end, the request's stats)."""

    ids: Sequence[int]
    max_new_tokens: int
    on_tokens: Callable[[list[int], str, GenerateStats | None], None]
    accept_cfg: AcceptConfig | None = None
    seed: int | None = None
    key: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False


class Scheduler:
    """Continuous batching behind a bounded queue, on a thread of its own (``start``/``stop``)."""

    def __init__(self, batch: BatchDecoder, max_queue: int = 64,
                 on_step: Callable[[list[StepTokens]], None] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.batch, self.max_queue, self.on_step = batch, max_queue, on_step
        self._queue: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._jobs: dict[int, Job] = {}  # in the batch, by key
        self._cancelled: set[int] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ from any thread

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self.batch.rows)

    def submit(self, job: Job) -> None:
        """Queue a request, or raise QueueFull."""
        with self._wake:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({len(self._queue)} requests waiting, "
                                f"{self.running} decoding); retry later")
            self._queue.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The request's client is gone: it leaves the queue, or its row is freed before the next step."""
        with self._wake:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
            else:
                self._cancelled.add(job.key)
            self._wake.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the loop's thread between two steps (work on the model outside the batch)."""
        done: Future = Future()
        with self._wake:
            self._calls.append((fn, done))
            self._wake.notify()
        return done

    def start(self) -> Scheduler:
        """The loop on a thread of its own (a server embedded in a process that keeps its main thread)."""
        self._thread = threading.Thread(target=self.run, name="medusa-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop's thread

    def run(self) -> None:
        """The loop, on the calling thread, until ``stop``. ``medusa-bench serve`` runs it on the process's main
        thread: the step's OpenMP parallel regions (PyTorch's kernels and the C forward alike) run markedly slower
        when a thread other than the process's main one starts them."""
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not (self._stopping or self._queue or self._calls or self.batch.rows or self._cancelled):
                    self._wake.wait()
                if self._stopping:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                calls = list(self._calls)
                self._calls.clear()
                joining = []
                while self._queue and len(joining) < self.batch.free + len(cancelled & set(self._jobs)):
                    joining.append(self._queue.popleft())
            for key in cancelled:
                self._jobs.pop(key, None)
                self.batch.drop(key)
            for fn, done in calls:
                _run_call(fn, done)
            for job in joining:
                self._admit(job)
            if self.batch.rows:
                self._step()
                if not self.batch.rows:
                    _release_freed_memory()

    def _admit(self, job: Job) -> None:
        try:
            self.batch.admit(job.key, job.ids, job.max_new_tokens, job.seed, job.accept_cfg)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own; the loop goes on
            job.on_tokens([], f"error: {str(exc).splitlines()[0]}", None)
            return
        self._jobs[job.key] = job

    def _step(self) -> None:
        try:
            got = self.batch.step()
        except Exception as exc:  # noqa: BLE001 - every row of a failed step is ended with the reason
            reason = f"error: {str(exc).splitlines()[0]}"
            for key in list(self.batch.rows):
                self.batch.drop(key)
                self._jobs.pop(key).on_tokens([], reason, None)
            return
        for step in got:
            job = self._jobs[step.key] if not step.stop else self._jobs.pop(step.key)
            if not job.cancelled:
                job.on_tokens(step.tokens, step.stop, step.stats)
        if self.on_step is not None:
            self.on_step(got)


def _release_freed_memory() -> None:
    """Hand the freed requests' caches back to the system when the batch empties (glibc keeps freed heap
    memory for reuse; a server idle after a burst would otherwise hold the burst's peak)."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _run_call(fn: Callable[[], object], done: Future) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        done.set_exception(exc)
