#!/bin/bash
# Session 15, call 5: the Mosaic GPU scoring prototype (TMA windows) without the XLA pad (TMA zero fill).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 170 python3 experiments/mgpu/time_scores.py > $OUT/time_scores.txt 2>&1; echo "time rc=$? $(( $(date +%s)-S ))s"
grep -v "^W\|^I0\|Warn" $OUT/time_scores.txt | cut -c1-300 | tail -30
