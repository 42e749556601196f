#!/bin/bash
# Session 39, call 3: rows_forward with 1-2 warps per program, fewer channel reductions (the gate's sums over the streams elementwise first) and the state loaded early, against the Mosaic kernel.

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 300 python experiments/mgpu/time_rows_forward.py 2>&1 | grep -v Warning | tee $OUT/rows_f32.txt
