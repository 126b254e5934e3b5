"""What a bench run reports: ``build.py`` (summary.md, report.json and the figures; ``python -m bench.report
--check OUT`` checks a run's report.json), ``scorecard.py`` (predicted against measured, report.json's schema and
the verdict's sentences), ``plots.py`` (paper-style figures), ``html.py`` and ``browser.py`` (report.html and its
check in a real browser), ``readme.py`` (the README's results block and docs/results.md), ``learning_curve.py``.
"""
