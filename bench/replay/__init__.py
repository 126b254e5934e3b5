"""Replaying questions: ``mtbench.py`` and ``suites.py`` (the question sets, offline), ``workload.py`` (which
questions replay and which calibrate, cross-fitted predictions), ``matrix.py`` (the configurations), ``runner.py``
(one runner contract for every decoding method, the interleaved resumable replay), ``distributed.py`` (the matrix
shared among machines), ``profile_rounds.py`` (the latency profile taken during the replay), ``analyze.py`` (the
records in pandas).
"""
