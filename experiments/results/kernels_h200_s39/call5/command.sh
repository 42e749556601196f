#!/bin/bash
# Session 39, call 5: the two timing scripts after their loops were shared (time_cluster_forward's
# compile_variants / time_variants), `base` only. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 150 python experiments/mgpu/time_rows_forward.py --base-only 2>&1 | grep -v Warning | tee $OUT/rows_f32.txt
timeout 120 python experiments/mgpu/time_cluster_forward.py --base-only --backward --only "1 wg" 2>&1 | grep -v Warning \
    | tee $OUT/cluster_backward.txt
