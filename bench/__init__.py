"""Benchmark harness and the ``medusa-bench`` command line."""
