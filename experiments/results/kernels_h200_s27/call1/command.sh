#!/bin/bash
# Session 27, call 1: phase 1's scoring pass with more chunks in flight and wider chunks (AttnRes
# and MSAR), and the query gradient's lagged operand built once. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
D=experiments/results/kernels_h200_s27/call1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
python experiments/mgpu/time_phase1_scores.py --attnres --slots 2>&1 | grep -v Warning | tee $OUT/scores_attnres.txt
python experiments/mgpu/time_phase1_scores.py --slots 2>&1 | grep -v Warning | tee $OUT/scores_msar.txt
python experiments/mgpu/time_query_grads.py 2>&1 | grep -v Warning | tee $OUT/query_grads.txt
