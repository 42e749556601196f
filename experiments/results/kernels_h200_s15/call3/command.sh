#!/bin/bash
# Session 15, call 3: where the Mosaic GPU scoring prototype goes wrong on the GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 200 python3 experiments/mgpu/diag_scores.py > $OUT/diag_scores.txt 2>&1; echo "rc=$? $(( $(date +%s)-S ))s"
grep -v "^W\|^I0\|Warn" $OUT/diag_scores.txt | tail -40
