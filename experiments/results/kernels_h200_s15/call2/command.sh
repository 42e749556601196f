#!/bin/bash
# Session 15, call 2: phase 2's scoring pass in Mosaic GPU (prototype) against Triton and XLA.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 400 python3 experiments/mgpu/time_scores.py > $OUT/time_scores.txt 2>&1; echo "rc=$? $(( $(date +%s)-S ))s"
grep -v "^W\|^I0\|Warn" $OUT/time_scores.txt | tail -40
