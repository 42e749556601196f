#!/bin/bash
# Session 38, call 2 (on the H100 still warm from call 1): the cluster forward with one warpgroup
# per CTA, clusters of 8 and 16, one cluster per tile and walking; the one-CTA kernel beside it. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
timeout 100 python experiments/mgpu/time_cluster_forward.py --only "pull      1 wg" 2>&1 \
    | grep -v "Warning\|cuda_\|Source Loc\|^$" | tail -12 | tee $OUT/cluster_forward_1wg.txt
