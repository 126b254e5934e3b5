"""``python -m bench.report --check OUT``: check a bench run's report.json (bench.report.build.main)."""

from bench.report.build import main

raise SystemExit(main())
