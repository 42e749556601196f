#!/bin/bash
# Session 15, call 4: the Mosaic GPU scoring prototype with one TMA window per lag.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 90 python3 experiments/mgpu/diag_scores.py > $OUT/diag_scores.txt 2>&1; echo "diag rc=$? $(( $(date +%s)-S ))s"
grep -v "^W\|^I0\|Warn" $OUT/diag_scores.txt | cut -c1-150 | tail -24
S=$(date +%s)
timeout 200 python3 experiments/mgpu/time_scores.py > $OUT/time_scores.txt 2>&1; echo "time rc=$? $(( $(date +%s)-S ))s"
grep -v "^W\|^I0\|Warn" $OUT/time_scores.txt | tail -30
