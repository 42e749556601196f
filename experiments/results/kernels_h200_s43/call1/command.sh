#!/bin/bash
# Session 43, call 1: phase 2's gated Mosaic kernels (the forward, the backward's state kernel)
# with the state's second read in the same chunk order or in reverse (mosaic_gpu.REREAD_ORDER),
# `base` and the issue's shape, three alternating rounds each; then the GPU test of phase 2's
# Mosaic kernels (against the oracle, each order). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
timeout 300 python experiments/mgpu/time_reread_order.py 2>&1 | grep -v Warning | tee $OUT/reread.txt
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase2.py \
    -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8 | tee $OUT/gpu_test.txt
