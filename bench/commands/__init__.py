"""The commands of ``medusa-bench``, one module per group (the parser and ``main`` are in :mod:`bench.cli`)."""
