#!/bin/bash
# Session 45, call 5: the new defaults (gdots and dstreams with a program per stream, dstreams' rows
# once per (head, stream)): phase 1's backward kernels' GPU test against the Triton passes (call 4's
# ran out of its 150 s), then the per-sublayer bench at the shape. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 300 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_bwd1.py -p no:cacheprovider \
    2>&1 | grep -E "passed|failed|Error|FAIL|assert" | tail -12 | tee $OUT/gpu_test.txt
echo "gpu test $(( $(date +%s)-S ))s"
timeout 200 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar 2>&1 | grep -v Warning \
    | tail -8 > $OUT/bench_msar.txt
grep -E "copy bandwidth|fwd:|fb:" $OUT/bench_msar.txt
echo "bench $(( $(date +%s)-S ))s"
