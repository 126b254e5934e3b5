#!/bin/bash
# Latency profiles of two checkouts in turn, A B B A A B, each `medusa-bench profile` at context 256 (nodes 1 2 3 4 8,
# 12 rounds), and one line per profile: the plain step, verify(2) / verify(4) / verify(8) over one row, heads +
# bookkeeping of a 4-node tree over the plain step, the plain step over its bandwidth floor
# (docs/reports/2026-12-03-verify-roofline.md).
#
#     bash docs/reports/2026-12-03-profile-ab.sh CHECKOUT_A CHECKOUT_B OUT_DIR
#
# Run from a checkout with a virtual environment at .venv (the package installed); each profile imports the
# package from its own checkout (PYTHONPATH), whose kernel source is compiled (and cached) on first use.
set -euo pipefail
a=$(realpath "$1") b=$(realpath "$2") out=$(realpath -m "$3")
py=$(realpath .venv/bin/python)
mkdir -p "$out"
i=0
for which in A B B A A B; do
    i=$((i + 1))
    dir=$a; [ "$which" = B ] && dir=$b
    (cd "$dir" && PYTHONPATH="$dir" "$py" -c 'import sys; from bench.cli import main; sys.argv[0] = "medusa-bench"; sys.exit(main())' \
        profile --heads default --dtype bfloat16 --nodes 1 2 3 4 8 --contexts 256 --prefill 256 --repeats 12 \
        --out "$out/$i-$which.json" > "$out/$i-$which.log" 2>&1)
    "$py" - "$out/$i-$which.json" "$i $which" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v, plain = d["verify_ms"][0], d["plain_ms"][0]
heads = dict(zip(d["heads_nodes"], d["heads_by_nodes_ms"]))
book = dict(zip(d["bookkeeping_nodes"], d["bookkeeping_by_nodes_ms"]))
print(f"{sys.argv[2]}: plain {plain:.2f} ms, verify(2) / (4) / (8) over one row {v[1] / v[0]:.3f} / {v[3] / v[0]:.3f} / "
      f"{v[4] / v[0]:.3f}, heads + bookkeeping at 4 nodes {100 * (heads[4] + book[4]) / plain:.1f} %, "
      f"plain over its floor {d['bandwidth_floor']['plain_over_floor']:.2f}")
PY
done
