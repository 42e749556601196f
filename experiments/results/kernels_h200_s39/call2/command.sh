#!/bin/bash
# Session 39, call 2: phase 2's forward with whole channel rows per program (rows_forward, the state
# read once) against the one-CTA Mosaic kernel, float32 and bf16 state, `base` and the issue's shape.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 300 python experiments/mgpu/time_rows_forward.py 2>&1 | grep -v Warning | tee $OUT/rows_f32.txt
timeout 200 python experiments/mgpu/time_rows_forward.py --bf16-state 2>&1 | grep -v Warning | tee $OUT/rows_bf16.txt
