#!/bin/bash
# Session 40, call 2: the transpose's options with and without Pallas' automatic barriers
# (mosaic_gpu_bwd1.TRANSPOSE_AUTO_BARRIERS), `base`'s last block and the issue's shape; then the
# GPU tests of phase 1's backward kernels (the transpose's option combinations bitwise against its
# defaults, the defaults against Triton) and phase 2's kernels at their new defaults against the
# oracle. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 240 python experiments/mgpu/time_inner_loops.py --transpose-only 2>&1 | grep -v Warning | tee $OUT/transpose.txt
JAX_PLATFORMS=cuda timeout 280 python -m pytest -v -m gpu tests/kernels/test_mosaic_gpu_bwd1.py \
    tests/kernels/test_mosaic_gpu_phase2.py -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|Error|error|passed|failed" \
    | tail -25 | tee $OUT/gpu_test.txt
