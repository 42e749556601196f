#!/bin/bash
# Session 42, call 3: the per-sublayer bench at the shape with INPUTS_SLOTS = 3 the default.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 300 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar 2>&1 | grep -v Warning \
    | tail -8 | tee $OUT/bench_msar.txt
echo "bench $(( $(date +%s)-S ))s"
