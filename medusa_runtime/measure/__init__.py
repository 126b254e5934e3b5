"""Measuring the runtime on a machine: ``calibrate.py`` (per head and rank acceptance on greedy rollouts ->
acceptance.json), ``profile.py`` (verify, heads and bookkeeping time against tree size -> latency.json),
``bandwidth.py`` (a decode step's memory-bandwidth floor)."""
