#!/bin/bash
# Session 36, call 2: session 35's call 2 (a) (dstreams with either window fetch) and call 5 (b)
# (the scoring pass's query dots on CUDA cores against the tensor cores, dots="tf32x3", since
# removed: commit 73339dd; run at 240c4c6). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 250 python experiments/mgpu/time_phase1_bwd.py --window-fetch --dstreams-only 2>&1 | grep -v Warning \
    | tee $OUT/dstreams_window_fetch.txt
echo "dstreams $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 250 python experiments/mgpu/time_phase1_scores.py --dots 2>&1 | grep -v Warning | tee $OUT/scores_dots.txt
echo "dots $(( $(date +%s)-S ))s"
