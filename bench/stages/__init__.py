"""What each command and the main job run: one module per group of stages, each stage a function of one frozen
job (``jobs.py``) that writes versioned files and returns (result object, text).

- ``jobs.py``: the jobs, one frozen dataclass per command, and their cache keys; ``defaults.py``: the values the
  command line and the stages share; ``cache.py``: the stage cache and the runtime revision that keys it;
- ``measure.py`` (model, generate, calibrate, validate, draft-vocab, profile), ``training.py`` (distill, train,
  learning-curve, self-prompts, fidelity), ``search.py`` (the search; no torch: the pipeline runs several side by
  side in spawned processes), ``trees.py`` (export, export-heads), ``replay.py`` (speed, replay, judge),
  ``serve.py``, ``deploy.py`` (tree.json to what a target engine loads);
- ``common.py``: loading the model and heads a job names, printing a result.

``bench.pipeline`` calls these stages in turn; ``medusa-bench`` (``bench.cli``) calls one.
"""
