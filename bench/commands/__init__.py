"""The subcommands of ``medusa-bench``: each module adds its commands' parsers (``add_<command>``), whose
``func`` names the function in ``bench.stages`` that runs it; ``flags.py`` is the one vocabulary they share.
``bench.cli`` assembles the parser and runs the chosen command."""
