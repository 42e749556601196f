#!/bin/bash
# Session 39, call 6: what holds rows_forward. The per-channel constants taken out one by one at
# `base` (2 tokens, 4 warps, the best tile): the gate (W: 64 KB a program) with mean fusion, then
# the taps too (96 KB) with identity streams (0, 0, 0, 0). The Mosaic kernel beside each. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
for flags in "" "--mean" "--mean --kernels 0,0,0,0"; do
  timeout 80 python experiments/mgpu/time_rows_forward.py --base-only --only "2 tokens  4 warps" $flags 2>&1 \
      | grep -v Warning | tee -a $OUT/rows_constants.txt
done
